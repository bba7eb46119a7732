"""The dtypes a model may use: their names, numpy types and byte sizes."""
from __future__ import annotations

import numpy as np

DTYPES = ("f32", "f16", "i32")
FLOAT_DTYPES = ("f32", "f16")
NUMPY_DTYPE = {"f32": np.float32, "f16": np.float16, "i32": np.int32}
ITEMSIZE = {name: np.dtype(t).itemsize for name, t in NUMPY_DTYPE.items()}


def dtype_of(array) -> str:
    """The dtype name of a numpy array (or dtype); TypeError for any other."""
    dt = np.dtype(getattr(array, "dtype", array))
    for name, np_dtype in NUMPY_DTYPE.items():
        if dt == np_dtype:
            return name
    raise TypeError(f"unsupported array dtype {dt}")
