"""The dtypes a model may use: their names, numpy types and byte sizes, and
the one place an array's dtype is named.

Policy for arrays from the host: `dtype_of(a)` is exact (f32, f16, i32, else
TypeError), for values that must already be what the model declares
(checkpoints, the IR's consts). A bf16 tensor lives on the host as a float32
array whose values are bf16's (numpy has no bf16): `as_dtype` rounds to it,
and on a device it is stored as the top 16 bits of each f32 (`bf16_bits`).
`dtype_of(a, narrow=True)` names the dtype a host array is narrowed to on
upload: float64 (numpy's default) becomes f32 and every integer width becomes
i32, as feeds and optimizer state are."""
from __future__ import annotations

import numpy as np

DTYPES = ("f32", "f16", "i32")        # what a model file declares
GRAPH_DTYPES = DTYPES + ("bf16",)     # bf16: only what dtype="mixed" computes in
FLOAT_DTYPES = ("f32", "f16", "bf16")
HALF_DTYPES = ("f16", "bf16")         # 16-bit storage, f32 arithmetic
# what a model is compiled in: "mixed" is 16-bit compute on f32 master params
# (losses in f32; in f16 the loss is scaled against underflow, bf16 has f32's range)
COMPILE_DTYPES = ("f32", "f16", "mixed")
# mixed precision's 16-bit type: "auto" takes bf16 where the device multiplies it on
# cooperative matrices, else f16 (flowgrad/mixed_choice.py)
MIXED_HALVES = ("auto", "bf16", "f16")
NUMPY_DTYPE = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "bf16": np.float32}
ITEMSIZE = {"f32": 4, "f16": 2, "i32": 4, "bf16": 2}   # on a device
LARGEST = {"f32": float(np.finfo(np.float32).max), "f16": float(np.finfo(np.float16).max),
           "bf16": 3.3895313892515355e38}   # (2 - 2**-7) * 2**127


def bf16_bits(x) -> np.ndarray:
    """float32 values as bf16 bits (uint16): rounded to nearest, ties to
    even, as PyTorch converts; an inf stays inf, a NaN stays a (quiet) NaN,
    a value past bf16's largest becomes inf, subnormals round as any value."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    with np.errstate(over="ignore"):
        rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16   # wraps only for NaNs, chosen below
    nan = (u >> 16) | 0x40
    return np.where(np.isnan(u.view(np.float32)), nan, rounded).astype(np.uint16)


def bf16_from_bits(bits) -> np.ndarray:
    """bf16 bits (uint16) as the float32 values they stand for (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _f32_rounded_to_odd(x) -> np.ndarray:
    """x as float32; a wider float rounded to odd (exact, or the f32 with an odd
    last bit beside it), so rounding that to bf16 is as rounding x itself."""
    a = np.asarray(x)
    if not (a.dtype.kind == "f" and a.dtype.itemsize > 4):
        return a.astype(np.float32, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):
        f = a.astype(np.float32)
        inexact = np.isfinite(f) & (f.astype(a.dtype) != a)
        toward_zero = np.where(inexact & (np.abs(f.astype(a.dtype)) > np.abs(a)),
                               np.nextafter(f, np.float32(0)), f)
    return np.where(inexact, (toward_zero.view(np.uint32) | 1).view(np.float32), f)


def round_bf16(x) -> np.ndarray:
    """x (any float) rounded once to bf16, as a float32 array."""
    a = _f32_rounded_to_odd(x)
    return bf16_from_bits(bf16_bits(a)).reshape(a.shape)


DEVICE_NUMPY = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "bf16": np.uint16}   # what a device stores


def device_array(x, dtype: str) -> np.ndarray:
    """x as the C-ordered array a device stores for `dtype` (bf16: its bits), shape kept."""
    shape = np.shape(x)
    if dtype == "bf16":
        return bf16_bits(_f32_rounded_to_odd(x)).reshape(shape)
    return np.ascontiguousarray(x, dtype=NUMPY_DTYPE[dtype]).reshape(shape)


def host_array(stored: np.ndarray, dtype: str) -> np.ndarray:
    """What a device stored for `dtype` (an array of DEVICE_NUMPY[dtype]) as the host's array."""
    return bf16_from_bits(stored).reshape(stored.shape) if dtype == "bf16" else stored


def as_dtype(x, dtype: str) -> np.ndarray:
    """x as the host array of `dtype` (bf16: float32 holding bf16's values)."""
    return round_bf16(x) if dtype == "bf16" else np.asarray(x, dtype=NUMPY_DTYPE[dtype])


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
