"""ONNX converters of the layer, activation, comparison and loss ops:
convolutions, pooling, batch and group norm, pad and flatten, where, the
clamps, the activations past relu, the comparisons, argmax and topk, and
the elementwise losses. Each is `convert(writer, node, input names, input
types) -> output name`, as in flowgrad/export_onnx.py."""
from __future__ import annotations

import numpy as np

from flowgrad.onnx_writer import dt
from flowgrad.ops.conv import geometry, transpose_geometry, tuple_of
from flowgrad.ops.pool import adaptive_size, bins, window
from flowgrad.ops.spatial import pad_widths

BOOL, INT64 = 9, 7   # ONNX TensorProto element types
ELEM = {"f32": 1, "f16": 10, "i32": 6}


def _pads(pairs) -> list[int]:
    """((before, after) per axis) as ONNX's [begins..., ends...]."""
    pairs = list(pairs)
    return [lo for lo, _ in pairs] + [hi for _, hi in pairs]


# ---------------------------------------------------------------- convolutions and pooling


def _conv(nd):
    def convert(w, n, ins, ts):
        geo = geometry(ts[0].shape, ts[1].shape, n.attrs, nd)
        keep = slice(2 - nd, None)   # conv1d's geometry is conv2d's over a height of 1
        return w.op("Conv", ins, kernel_shape=list(ts[1].shape[2:]), strides=list(geo["stride"][keep]),
                    dilations=list(geo["dilation"][keep]), pads=_pads(geo["pads"][keep]), group=geo["groups"])
    return convert


def _conv_transpose(w, n, ins, ts):
    geo = transpose_geometry(ts[0].shape, ts[1].shape, n.attrs)
    return w.op("ConvTranspose", ins, kernel_shape=list(ts[1].shape[2:]), strides=list(geo["stride"]),
                dilations=list(geo["dilation"]), pads=_pads(geo["pads"]), group=geo["groups"],
                output_padding=list(tuple_of("output_padding", n.attrs["output_padding"], 2, 0)))


def _pool(kind):
    def convert(w, n, ins, ts):
        win = window(ts[0].shape, n.attrs)
        extra = {"count_include_pad": int(n.attrs["count_include_pad"])} if kind == "AveragePool" else {}
        return w.op(kind, ins, kernel_shape=list(win["kernel"]), strides=list(win["stride"]),
                    pads=_pads((p, p) for p in win["pad"]), **extra)
    return convert


def _adaptive_avgpool(w, n, ins, ts):
    """Even bins are an AveragePool; uneven ones (PyTorch's overlapping bins)
    are a product with each axis's averaging matrix."""
    w.fixed(n, n.inputs[0], (2, 3), "its height and width")
    (h, wd), out = ts[0].shape[2:], adaptive_size(ts[0].shape, n.attrs)
    if out == (1, 1):
        return w.op("GlobalAveragePool", ins)
    if h % out[0] == 0 and wd % out[1] == 0:
        kernel = [h // out[0], wd // out[1]]
        return w.op("AveragePool", ins, kernel_shape=kernel, strides=kernel)

    def averaging(size, count):
        m = np.zeros((count, size), dt(n))
        for i, (lo, hi) in enumerate(bins(size, count)):
            m[i, lo:hi] = 1.0 / (hi - lo)
        return w.const(m)

    rows = w.op("MatMul", [averaging(h, out[0]), ins[0]])             # [N, C, oh, W]
    return w.op("MatMul", [rows, w.op("Transpose", [averaging(wd, out[1])], perm=[1, 0])])


# ---------------------------------------------------------------- normalization and shape


def _per_channel(w, v, rank):
    """[C] as [C, 1, ...] to broadcast against [N, C, ...]."""
    return w.op("Unsqueeze", [v, w.ints(range(1, rank - 1))]) if rank > 2 else v


def _batchnorm(w, n, ins, ts):
    """In eval, with the running statistics (the export is the inference graph)."""
    x, weight, bias, mean, var = ins[:5]
    if ts[3].dtype != n.dtype:   # dtype="mixed" keeps f32 statistics beside f16 data
        mean, var = (w.op("Cast", [v], to=ELEM[n.dtype]) for v in (mean, var))
    return w.op("BatchNormalization", [x, weight, bias, mean, var], epsilon=float(n.attrs["eps"]))


def _groupnorm(w, n, ins, ts):
    """Opset 17 has no GroupNormalization: the statistics over [N, G, -1] rows."""
    x, weight, bias = ins
    w.fixed(n, n.inputs[0], (1,), "its channel axis")
    rank, d = len(ts[0].shape), dt(n)
    rows = w.op("Reshape", [x, w.ints([0, n.attrs["groups"], -1])])   # 0: the fed batch
    centred = w.op("Sub", [rows, w.op("ReduceMean", [rows], axes=[2], keepdims=1)])
    var = w.op("ReduceMean", [w.op("Mul", [centred, centred])], axes=[2], keepdims=1)
    xhat = w.op("Div", [centred, w.op("Sqrt", [w.op("Add", [var, w.scalar(n.attrs["eps"], d)])])])
    xhat = w.op("Reshape", [xhat, w.op("Shape", [x])])
    return w.op("Add", [w.op("Mul", [xhat, _per_channel(w, weight, rank)]), _per_channel(w, bias, rank)])


def _pad(w, n, ins, ts):
    widths = pad_widths(ts[0].shape, n.attrs)
    return w.op("Pad", [ins[0], w.ints(_pads(widths)), w.scalar(n.attrs["value"], dt(n))], mode="constant")


def _embedding_grad(w, n, ins, ts):
    """A [rows, d] table of zeros with each row of g added at its id."""
    ids, g = ins
    zeros = w.const(np.zeros((n.attrs["rows"], ts[1].shape[-1]), dt(n)))
    at = w.op("Unsqueeze", [w.op("Cast", [ids], to=INT64), w.ints([-1])])
    return w.op("ScatterND", [zeros, at, g], reduction="add")


# ---------------------------------------------------------------- elementwise


def _scalar_op(kind, attr):
    return lambda w, n, ins, ts: w.op(kind, [ins[0], w.scalar(n.attrs[attr], dt(n))])


def _softplus(w, n, ins, ts):
    """log(1 + e^(beta x)) / beta, and x itself where beta x > threshold."""
    (x,), d = ins, dt(n)
    bx = w.op("Mul", [x, w.scalar(n.attrs["beta"], d)])
    soft = w.op("Div", [w.op("Softplus", [bx]), w.scalar(n.attrs["beta"], d)])
    return w.op("Where", [w.op("Greater", [bx, w.scalar(n.attrs["threshold"], d)]), x, soft])


def _compare(kind, negate=False):
    """ONNX compares to bool; flowgrad gives 1 or 0 in the operands' dtype."""
    def convert(w, n, ins, ts):
        out = w.op(kind, ins)
        return w.op("Cast", [w.op("Not", [out]) if negate else out], to=ELEM[n.dtype])
    return convert


def _argmax(w, n, ins, ts):
    out = w.op("ArgMax", ins, axis=n.attrs["axis"], keepdims=int(bool(n.attrs["keepdims"])), select_last_index=0)
    return w.op("Cast", [out], to=ELEM["i32"])


def _topk(index):
    """TopK, sorted largest first, puts the lower index first among equal values, as flowgrad does."""
    def convert(w, n, ins, ts):
        values, where = w.op_n("TopK", [ins[0], w.ints([n.attrs["k"]])], 2, axis=n.attrs["axis"], largest=1,
                               sorted=1)
        return w.op("Cast", [where], to=ELEM["i32"]) if index else values
    return convert


# ---------------------------------------------------------------- losses: means over elements


def _mean(w, x):
    return w.op("ReduceMean", [x], keepdims=0)


def _l1(w, n, ins, ts):
    return _mean(w, w.op("Abs", [w.op("Sub", ins)]))


def _huber(w, n, ins, ts):
    """0.5 d^2 where |d| < delta, else delta (|d| - delta / 2)."""
    d, delta = w.op("Abs", [w.op("Sub", ins)]), n.attrs["delta"]
    near = w.op("Mul", [w.scalar(0.5, dt(n)), w.op("Mul", [d, d])])
    far = w.op("Mul", [w.scalar(delta, dt(n)), w.op("Sub", [d, w.scalar(0.5 * delta, dt(n))])])
    return _mean(w, w.op("Where", [w.op("Less", [d, w.scalar(delta, dt(n))]), near, far]))


def _bce_with_logits(w, n, ins, ts):
    """max(x, 0) - x y + log(1 + e^-|x|), the stable form flowgrad computes."""
    x, y = ins
    tail = w.op("Softplus", [w.op("Neg", [w.op("Abs", [x])])])
    return _mean(w, w.op("Add", [w.op("Sub", [w.op("Relu", [x]), w.op("Mul", [x, y])]), tail]))


LAYER_CONVERTERS = {
    "conv1d": _conv(1), "conv2d": _conv(2), "conv_transpose2d": _conv_transpose,
    "maxpool2d": _pool("MaxPool"), "avgpool2d": _pool("AveragePool"), "adaptive_avgpool2d": _adaptive_avgpool,
    "batchnorm": _batchnorm, "groupnorm": _groupnorm, "pad": _pad,
    "flatten": lambda w, n, ins, ts: w.op("Reshape", [ins[0], w.shape(n.id, reshape=True)]),
    "embedding_grad": _embedding_grad,
    "maximum": lambda w, n, ins, ts: w.op("Max", ins), "minimum": lambda w, n, ins, ts: w.op("Min", ins),
    # cond comes in its operands' dtype (the op's expand casts it): nonzero is true
    "where": lambda w, n, ins, ts: w.op("Where", [w.op("Cast", [ins[0]], to=BOOL), ins[1], ins[2]]),
    "abs": lambda w, n, ins, ts: w.op("Abs", ins), "erf": lambda w, n, ins, ts: w.op("Erf", ins),
    "clamp_min": _scalar_op("Max", "min"), "clamp_max": _scalar_op("Min", "max"),
    "softplus": _softplus,
    "leaky_relu": lambda w, n, ins, ts: w.op("LeakyRelu", ins, alpha=float(n.attrs["negative_slope"])),
    "elu": lambda w, n, ins, ts: w.op("Elu", ins, alpha=float(n.attrs["alpha"])),
    "eq": _compare("Equal"), "ne": _compare("Equal", negate=True), "lt": _compare("Less"),
    "le": _compare("LessOrEqual"), "gt": _compare("Greater"), "ge": _compare("GreaterOrEqual"),
    "argmax": _argmax, "topk": _topk(False), "topk_indices": _topk(True),
    "l1_loss": _l1, "huber_loss": _huber, "bce_with_logits": _bce_with_logits,
}
