"""What is fed to a graph's inputs: the checks a feed passes before a step
(names, shapes, dtypes, i32 range, index bounds; check_feeds), and random
feeds for benchmarks and `explain --analyze` (random_feeds: timings, not
results, so any valid values will do)."""
from __future__ import annotations

import numpy as np

from flowgrad.dtypes import FLOAT_DTYPES, LARGEST, NUMPY_DTYPE, as_dtype, dtype_of
from flowgrad.errors import FlowError
from flowgrad.graph import LEAF_OPS, Graph
from flowgrad.ops import get_op


def random_feeds(graph, seed: int = 0, int_high: int = 1) -> dict[str, np.ndarray]:
    """Floats drawn from N(0, 1); integers (token ids, targets) from [0, int_high),
    and below the size of each index op that reads them (a classifier's targets
    below its classes): the default, all zeros, is a valid index for any index op."""
    rng = np.random.default_rng(seed)
    uses = index_uses(graph)
    out = {}
    for name, i in graph.inputs.items():
        t = graph.nodes[i].type
        if t.dtype == "i32":
            high = min([int_high] + [n for n, _ in uses.get(i, [])])
            out[name] = rng.integers(0, high, t.shape, dtype=np.int32)
        else:
            out[name] = as_dtype(rng.standard_normal(t.shape).astype(np.float32), t.dtype)
    return out


def check_feeds(graph: Graph, feeds: dict[str, np.ndarray], uses: dict[int, list]) -> dict[str, np.ndarray]:
    """The feeds as C-ordered arrays of each input's dtype, after checking
    names, shapes, dtypes and ranges (i32, and the index bounds `uses` from
    index_uses(graph) gives); a bad one is a FlowError at the input."""
    g = graph
    if not isinstance(feeds, dict):
        raise FlowError(f"feeds must be a dict of input name -> array, got {type(feeds).__name__}")
    unknown = sorted((str(k) for k in feeds if not isinstance(k, str) or k not in g.inputs))
    if unknown:
        raise FlowError(f"feed {unknown[0]!r} is not an input of {g.name} (inputs: {', '.join(g.inputs)})")
    out = {}
    for name, nid in g.inputs.items():
        node = g.nodes[nid]
        if name not in feeds:
            raise FlowError(f"missing feed for input {name!r} ({node.type})", node.span)
        value = feeds[name]
        # a C-ordered array of the input's shape and dtype is taken as it is (an i32 one is in range;
        # a bf16 one is rounded to bf16 on the way)
        if node.dtype == "bf16" or not (type(value) is np.ndarray and value.dtype == NUMPY_DTYPE[node.dtype]
                                        and value.shape == node.shape and value.flags.c_contiguous):
            value = converted(node, name, value)
        out[name] = value
        check_indices(node, value, uses.get(nid, ()))
    return out


def converted(node, name: str, value) -> np.ndarray:
    """Feed `name` for input `node` as a C-ordered array of its dtype, after
    checking its shape, dtype and i32 range."""
    return typed_array(value, f"feed {name!r}", f"input {name}", node)


def typed_array(value, what: str, target: str, node) -> np.ndarray:
    """`value` (called `what` in errors) as a C-ordered array of node's type
    (`target`'s, in errors): the same shape, any float for a float type, any
    int in i32's range for i32."""
    arr = numeric_array(value, what, node.span)
    if arr.shape != node.shape:
        raise FlowError(f"{what} has shape {list(arr.shape)}, but {target} is {node.type}", node.span)
    try:
        narrowed = dtype_of(arr, narrow=True)
    except TypeError:
        narrowed = None
    if narrowed is None or (narrowed == "i32") != (node.dtype == "i32"):
        raise FlowError(f"{what} has dtype {arr.dtype}, but {target} is {node.type}", node.span)
    if node.dtype == "i32":
        check_int32(node, arr)
    # not ascontiguousarray, which would make a 0-d feed [1]
    out = as_float(arr, node.dtype) if node.dtype in FLOAT_DTYPES else np.asarray(arr, np.int32, order="C")
    at = overflowed(arr, out)
    if at is not None:
        raise FlowError(f"{what} holds {arr[at]} at {list(map(int, at))}, {outside_float(node.dtype)}", node.span)
    return out


def as_float(arr: np.ndarray, dtype: str) -> np.ndarray:
    """`arr` as a C-ordered array of the float dtype; a value past its range
    becomes inf (overflowed finds it), with no numpy warning."""
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(as_dtype(arr, dtype)) if dtype == "bf16" else np.asarray(arr, NUMPY_DTYPE[dtype], order="C")


def overflowed(arr: np.ndarray, out: np.ndarray) -> tuple | None:
    """The index of the first value of `arr` that is finite but became inf
    in `out` (arr cast to a narrower float), or None."""
    if out.dtype.kind != "f" or (arr.dtype.kind == "f" and arr.dtype.itemsize <= out.dtype.itemsize):
        return None
    inf = np.isinf(out)
    if not inf.any():
        return None
    bad = np.flatnonzero(inf & np.isfinite(arr))
    return np.unravel_index(bad[0], arr.shape) if bad.size else None


def outside_float(dtype: str) -> str:
    return f"outside the {dtype} range (largest {LARGEST[dtype]:g}): it would be inf"


def numeric_array(value, what: str, span=None) -> np.ndarray:
    """A feed or param value as an array of numbers (bool, int or float)."""
    if value is None or isinstance(value, (str, bytes, dict)):
        raise FlowError(f"{what} must be an array of numbers, got {type(value).__name__}", span)
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise FlowError(f"{what} is not an array of numbers: {e}", span) from None
    if arr.dtype.kind not in "biuf":
        raise FlowError(f"{what} must be an array of numbers, got dtype {arr.dtype}", span)
    return arr


I32_RANGE = f"outside the i32 range ({np.iinfo(np.int32).min}..{np.iinfo(np.int32).max})"


def check_int32(node, values: np.ndarray) -> None:
    """An int feed is narrowed to i32: a value outside its range would wrap."""
    at = outside_i32(values)
    if at is not None:
        raise FlowError(f"feed {node.name!r} holds {values[at]} at {list(map(int, at))}, {I32_RANGE}", node.span)


def outside_i32(values: np.ndarray) -> tuple | None:
    """The index of the first value outside i32's range, or None (values: ints, or whole floats)."""
    if values.dtype.itemsize <= 4 and values.dtype.kind == "i" or values.size == 0:
        return None
    info = np.iinfo(np.int32)
    bad = np.flatnonzero((values < info.min) | (values > info.max))
    return np.unravel_index(bad[0], values.shape) if bad.size else None


def index_uses(graph: Graph) -> dict[int, list]:
    """Inputs that ops read as indices (embedding ids, cross_entropy targets):
    input id -> [(n, user node)], each index valid in [0, n)."""
    uses: dict[int, list] = {}
    for user in graph.nodes:
        bounds_of = None if user.op in LEAF_OPS else get_op(user.op).index_bounds
        if bounds_of is None:
            continue
        for pos, n in bounds_of([graph.nodes[i].type for i in user.inputs], user.attrs).items():
            if graph.nodes[user.inputs[pos]].op == "input":
                uses.setdefault(user.inputs[pos], []).append((n, user))
    return uses


def check_indices(node, values: np.ndarray, uses: list) -> None:
    """Range-check a feed used as indices on the host: a device kernel would
    read garbage or give NaN instead of raising."""
    if not uses or values.size == 0:
        return
    top = largest_index(values)
    for n, user in uses:
        if top < n:   # every index in range; else find the first bad one, ignored ones aside
            continue
        ignored = values == user.attrs["ignore_index"] if "ignore_index" in user.attrs else False
        bad = np.flatnonzero(((values < 0) | (values >= n)) & np.logical_not(ignored))
        if bad.size:
            at = np.unravel_index(bad[0], values.shape)
            raise FlowError(f"feed {node.name!r} holds {values[at]} at {list(map(int, at))}, out of range for "
                            f"{user.op} at {user.span.where() if user.span else '?'} (valid: 0..{n - 1})",
                            node.span)


def largest_index(values: np.ndarray):
    """A number below n exactly when every value is an index in [0, n): the
    largest as unsigned for i32 (a negative one is past 2**31), else
    infinity when one is negative or NaN."""
    if values.dtype == np.int32:
        return values.view(np.uint32).max()
    lo, hi = values.min(), values.max()
    return hi if lo >= 0 else np.inf
