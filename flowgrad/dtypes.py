"""The dtypes a model may use: their names, numpy types and byte sizes, and
the one place an array's dtype is named.

Policy for arrays from the host: `dtype_of(a)` is exact (f32, f16, i32, else
TypeError), for values that must already be what the model declares
(checkpoints, the IR's consts). `dtype_of(a, narrow=True)` names the dtype a
host array is narrowed to on upload: float64 (numpy's default) becomes f32 and
every integer width becomes i32, as feeds and optimizer state are."""
from __future__ import annotations

import numpy as np

DTYPES = ("f32", "f16", "i32")
FLOAT_DTYPES = ("f32", "f16")
# what a model is compiled in: "mixed" is f16 compute on f32 master params
# (losses in f32, the loss scaled against f16 underflow)
COMPILE_DTYPES = ("f32", "f16", "mixed")
NUMPY_DTYPE = {"f32": np.float32, "f16": np.float16, "i32": np.int32}
ITEMSIZE = {name: np.dtype(t).itemsize for name, t in NUMPY_DTYPE.items()}


def dtype_of(array, narrow: bool = False) -> str:
    """The dtype name of a numpy array (or dtype); TypeError for any other.
    narrow=True: any float but f16 is f32, any integer is i32."""
    dt = np.dtype(getattr(array, "dtype", array))
    for name, np_dtype in NUMPY_DTYPE.items():
        if dt == np_dtype:
            return name
    if narrow and dt.kind == "f":
        return "f32"
    if narrow and dt.kind in "iu":
        return "i32"
    raise TypeError(f"unsupported array dtype {dt}")
