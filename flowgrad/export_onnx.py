"""ONNX export of a session's forward graph with its current params:
`sess.to_onnx(path)` and `flowgrad export MODEL --checkpoint C -o model.onnx`.

The exported graph computes the model's outputs that do not read the
targets (the loss and what depends on it are left out unless asked for).
Its inputs' batch axis is symbolic, and every size that follows it is read
off the fed input (flowgrad/onnx_writer.py), so one file runs at any batch
size; a model whose batch size is not a config key, or an export with
dynamic_batch=False, is written at the session's own sizes. Params are
initializers; inputs and outputs keep their names. Opset 17, the first with
LayerNormalization. Each flowgrad op is written as the ONNX ops below and in
flowgrad/onnx_layers.py; an op in REFUSED, or missing from the table (an op
registered from Python, say), is a FlowError naming the node and its line.
A scan is first written out step by step (flowgrad/onnx_unroll.py).
Needs the `onnx` package (`pip install 'flowgrad[onnx]'`)."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.graph import Graph
from flowgrad.onnx_layers import LAYER_CONVERTERS
from flowgrad.onnx_unroll import unrolled
from flowgrad.onnx_writer import Writer, scaled_dims
from flowgrad.onnx_writer import axes_of as _axes
from flowgrad.onnx_writer import dt as _dt

OPSET = 17


def _onnx():
    try:
        import onnx
    except ImportError:
        raise FlowError("ONNX export needs the onnx package: pip install 'flowgrad[onnx]' "
                        "(or pip install onnx)") from None
    return onnx


def _binary(kind):
    return lambda w, n, ins, ts: w.op(kind, ins)


def _unary(kind):
    return lambda w, n, ins, ts: w.op(kind, ins)


def _gelu(w, n, ins, ts):
    (x,) = ins
    dt = _dt(n)
    half = w.scalar(0.5, dt)
    one = w.scalar(1.0, dt)
    if n.attrs["approximate"] == "tanh":
        cube = w.op("Mul", [w.scalar(0.044715, dt), w.op("Mul", [x, w.op("Mul", [x, x])])])
        inner = w.op("Mul", [w.scalar(math.sqrt(2.0 / math.pi), dt), w.op("Add", [x, cube])])
        return w.op("Mul", [w.op("Mul", [half, x]), w.op("Add", [one, w.op("Tanh", [inner])])])
    erf = w.op("Erf", [w.op("Div", [x, w.scalar(math.sqrt(2.0), dt)])])
    return w.op("Mul", [w.op("Mul", [half, x]), w.op("Add", [one, erf])])


def _reduce(kind):
    def convert(w, n, ins, ts):
        axes = _axes(n.attrs["axis"], len(ts[0].shape))
        keep = int(bool(n.attrs["keepdims"]))
        if kind == "ReduceSum":  # axes is an input from opset 13 on, an attribute for the others until 18
            return w.op(kind, [ins[0], w.ints(axes)], keepdims=keep)
        return w.op(kind, ins, axes=axes, keepdims=keep)
    return convert


def _slice(w, n, ins, ts):
    at = n.attrs
    return w.op("Slice", [ins[0], w.ints([at["start"]]), w.ints([at["stop"]]), w.ints([at["axis"]])])


def _transpose(w, n, ins, ts):
    rank = len(ts[0].shape)
    perm = list(range(rank))
    a, b = n.attrs["dim0"] % rank, n.attrs["dim1"] % rank
    perm[a], perm[b] = perm[b], perm[a]
    return w.op("Transpose", ins, perm=perm)


def _permute(w, n, ins, ts):
    rank = len(ts[0].shape)
    return w.op("Transpose", ins, perm=[d % rank for d in n.attrs["dims"]])


def _rmsnorm(w, n, ins, ts):
    x, weight = ins
    dt = _dt(n)
    axes = list(range(-len(ts[1].shape), 0))  # the trailing axes weight spans
    ms = w.op("ReduceMean", [w.op("Mul", [x, x])], axes=axes, keepdims=1)
    scale = w.op("Sqrt", [w.op("Add", [ms, w.scalar(n.attrs["eps"], dt)])])
    return w.op("Mul", [w.op("Div", [x, scale]), weight])


def _attention(w, n, ins, ts):
    """softmax(q k^T / sqrt(d/h) + mask) v per head, as MatMul and Softmax."""
    q, k, v = ins[:3]
    h = n.attrs["heads"]
    dt = _dt(n)

    for i in n.inputs[:3]:   # the heads' reshape and the causal mask are written for these sizes
        w.fixed(n, i, (-2,), "its sequence axis")

    def heads(x, t):
        s, d = t.shape[-2:]
        return w.op("Transpose", [w.op("Reshape", [x, w.ints([-1, s, h, d // h])])], perm=[0, 2, 1, 3])

    qh, kh, vh = heads(q, ts[0]), heads(k, ts[1]), heads(v, ts[2])
    d = ts[0].shape[-1]
    scores = w.op("Div", [w.op("MatMul", [qh, w.op("Transpose", [kh], perm=[0, 1, 3, 2])]),
                          w.scalar(math.sqrt(d // h), dt)])
    if len(ins) > 3:
        if ts[3].dtype == "i32":   # boolean: nonzero attends
            hidden = w.op("Equal", [ins[3], w.const(np.zeros((), np.int32))])
            scores = w.op("Where", [hidden, w.scalar(-np.inf, dt), scores])
        else:
            scores = w.op("Add", [scores, ins[3]])
    if n.attrs["causal"]:   # an index rule in flowgrad; a const additive mask here
        above = np.triu(np.ones((ts[0].shape[-2], ts[1].shape[-2]), bool), k=1)
        scores = w.op("Add", [scores, w.const(np.where(above, -np.inf, 0.0).astype(dt))])
    probs = w.op("Softmax", [scores], axis=-1)
    if len(ins) > 3:
        # ONNX's Softmax of a row that is -inf throughout is NaN; flowgrad (and PyTorch's
        # scaled_dot_product_attention) give such a fully masked query row zeros
        top = w.op("ReduceMax", [scores], axes=[-1], keepdims=1)
        attends = w.op("Not", [w.op("IsInf", [top], detect_positive=0)])
        probs = w.op("Where", [attends, probs, w.scalar(0.0, dt)])
    out = w.op("MatMul", [probs, vh])
    return w.op("Reshape", [w.op("Transpose", [out], perm=[0, 2, 1, 3]), w.shape(n.id, reshape=True)])


def _class_loss(kind):
    """cross_entropy / nll_loss as ONNX's loss op (mean reduction, weight,
    ignore_index), which wants the classes on axis 1."""
    def convert(w, n, ins, ts):
        x, targets, *weight = ins
        nd = len(ts[0].shape)
        axis = n.attrs["axis"] % nd
        if nd == 1:  # one row: [C] -> [1, C]
            x, targets = w.op("Unsqueeze", [x, w.ints([0])]), w.op("Unsqueeze", [targets, w.ints([0])])
        elif axis != 1:  # the targets' axes are the others, in order, as ONNX wants them
            rest = [d for d in range(nd) if d != axis]
            x = w.op("Transpose", [x], perm=[rest[0], axis, *rest[1:]])
        targets = w.op("Cast", [targets], to=7)
        if n.attrs.get("label_smoothing"):   # cross_entropy has it, nll_loss does not
            w.fixed(n, n.inputs[0], (axis,), "its class axis")
            return _smoothed(w, n, x, targets, weight, ts[0].shape[axis], max(nd, 2))
        return w.op(kind, [x, targets, *weight], reduction="mean", ignore_index=int(n.attrs["ignore_index"]))
    return convert


def _smoothed(w, n, x, targets, weight, classes, rank):
    """Label smoothing, which ONNX's loss op lacks: ((1 - eps) * the weighted
    nll sum + eps / C * the weighted sum of every class's nll) / the targets'
    weight, over the targets other than ignore_index, as flowgrad computes.
    x is [N, C, ...] (`rank` axes), targets [N, ...]."""
    dt, eps, ignore = _dt(n), n.attrs["label_smoothing"], int(n.attrs["ignore_index"])
    nll, log_probs = w.op_n("SoftmaxCrossEntropyLoss", [x, targets, *weight], 2, reduction="none",
                            ignore_index=ignore)
    counts = w.op("Not", [w.op("Equal", [targets, w.const(np.asarray(ignore, np.int64))])])
    valid = w.op("Cast", [counts], to={"f32": 1, "f16": 10}[n.dtype])
    every = w.op("Mul", [log_probs, w.op("Unsqueeze", [valid, w.ints([1])])])   # [N, C, ...]
    if weight:
        every = w.op("Mul", [every, w.op("Reshape", [weight[0], w.ints([1, classes] + [1] * (rank - 2))])])
        safe = w.op("Where", [counts, targets, w.const(np.asarray(0, np.int64))])   # ignore_index may be any int
        valid = w.op("Mul", [valid, w.op("Gather", [weight[0], safe])])
    total = w.op("Add", [w.op("Mul", [w.scalar(1 - eps, dt), w.op("ReduceSum", [nll], keepdims=0)]),
                         w.op("Mul", [w.scalar(-eps / classes, dt), w.op("ReduceSum", [every], keepdims=0)])])
    return w.op("Div", [total, w.op("ReduceSum", [valid], keepdims=0)])


def _mse(w, n, ins, ts):
    diff = w.op("Sub", ins)
    return w.op("ReduceMean", [w.op("Mul", [diff, diff])], keepdims=0)


def _cast(w, n, ins, ts):
    return w.op("Cast", ins, to={"f32": 1, "f16": 10, "i32": 6}[n.dtype])


# convert(writer, node, input names, input types) -> output name. A shape the
# graph needs (a Reshape's target) is writer.shape(node.id), which follows the
# fed batch size, never node.shape, which holds the export's own.
CONVERTERS = {
    **LAYER_CONVERTERS,
    "add": _binary("Add"), "sub": _binary("Sub"), "mul": _binary("Mul"), "div": _binary("Div"),
    "matmul": _binary("MatMul"),
    "neg": _unary("Neg"), "exp": _unary("Exp"), "log": _unary("Log"), "sqrt": _unary("Sqrt"),
    "tanh": _unary("Tanh"), "sin": _unary("Sin"), "cos": _unary("Cos"), "sigmoid": _unary("Sigmoid"),
    "relu": _unary("Relu"),
    "silu": lambda w, n, ins, ts: w.op("Mul", [ins[0], w.op("Sigmoid", ins)]),
    "gelu": _gelu,
    "pow": lambda w, n, ins, ts: w.op("Pow", [ins[0], w.scalar(n.attrs["exponent"], _dt(n))]),
    "sum": _reduce("ReduceSum"), "mean": _reduce("ReduceMean"), "max": _reduce("ReduceMax"),
    "min": _reduce("ReduceMin"), "logsumexp": _reduce("ReduceLogSumExp"),
    "softmax": lambda w, n, ins, ts: w.op("Softmax", ins, axis=n.attrs["axis"]),
    "log_softmax": lambda w, n, ins, ts: w.op("LogSoftmax", ins, axis=n.attrs["axis"]),
    "reshape": lambda w, n, ins, ts: w.op("Reshape", [ins[0], w.shape(n.id, reshape=True)]),
    "broadcast_to": lambda w, n, ins, ts: w.op("Expand", [ins[0], w.shape(n.id)]),
    "stop_gradient": lambda w, n, ins, ts: w.op("Identity", ins[:1]),
    "softsign": lambda w, n, ins, ts: w.op("Softsign", ins[:1]),
    "transpose": _transpose, "permute": _permute, "slice": _slice,
    "concat": lambda w, n, ins, ts: w.op("Concat", ins, axis=n.attrs["axis"] % len(n.shape)),
    "embedding": lambda w, n, ins, ts: w.op("Gather", [ins[1], ins[0]], axis=0),
    "layernorm": lambda w, n, ins, ts: w.op("LayerNormalization", ins, axis=-len(ts[1].shape),
                                            epsilon=float(n.attrs["eps"])),
    "rmsnorm": _rmsnorm,
    "attention": _attention,
    "cross_entropy": _class_loss("SoftmaxCrossEntropyLoss"), "nll_loss": _class_loss("NegativeLogLikelihoodLoss"),
    "mse_loss": _mse,
    "cast": _cast,
    # the export is the inference graph, where dropout is the identity (its hidden rng input is not exported)
    "dropout": lambda w, n, ins, ts: w.op("Identity", ins[:1]),
}
_FLOAT = {"f32": 1, "f16": 10}   # ONNX's element types


def _variance(root):
    """The centred squares' sum over N - correction (its root for std); N,
    the count reduced, is read off the tensors (x's size over the result's),
    so it holds at any size of an axis that follows the batch."""
    def convert(w, n, ins, ts):
        axes = _axes(n.attrs["axis"], len(ts[0].shape))
        centred = w.op("Sub", [ins[0], w.op("ReduceMean", ins, axes=axes, keepdims=1)])
        total = w.op("ReduceSum", [w.op("Mul", [centred, centred]), w.ints(axes)], keepdims=int(n.attrs["keepdims"]))
        count = w.op("Div", [w.op("Cast", [w.op("Size", ins)], to=_FLOAT[n.dtype]),
                             w.op("Cast", [w.op("Size", [total])], to=_FLOAT[n.dtype])])
        var = w.op("Div", [total, w.op("Sub", [count, w.scalar(n.attrs["correction"], _dt(n))])])
        return w.op("Sqrt", [var]) if root else var
    return convert


def _reach(w, x, x_shape, index_shape, axis):
    """x sliced to index's extent on every axis but `axis` (None: every
    axis); only where the two differ, so an axis both share (the batch) is
    left to the runtime's size."""
    cut = [d for d, (xn, n) in enumerate(zip(x_shape, index_shape)) if xn != n and d != axis]
    if not cut:
        return x
    return w.op("Slice", [x, w.ints([0] * len(cut)), w.ints([index_shape[d] for d in cut]), w.ints(cut)])


def _gather(w, n, ins, ts):
    axis = n.attrs["axis"] % len(n.shape)
    return w.op("GatherElements", [_reach(w, ins[0], ts[0].shape, ts[1].shape, axis), ins[1]], axis=axis)


def _scatter_add(w, n, ins, ts):
    x, index, src = ins
    axis = n.attrs["axis"] % len(n.shape)
    return w.op("ScatterElements", [x, index, _reach(w, src, ts[2].shape, ts[1].shape, None)], axis=axis,
                reduction="add")


def _one_hot(w, n, ins, ts):
    hits = w.op("Equal", [w.op("Unsqueeze", [ins[0], w.ints([-1])]), w.const(np.arange(n.attrs["n"], dtype=np.int32))])
    return w.op("Cast", [hits], to=_FLOAT[n.dtype])


def _squeeze(w, n, ins, ts):
    from flowgrad.ops.shape import squeezed_axes

    gone = squeezed_axes(ts[0].shape, n.attrs["axis"])
    return w.op("Squeeze", [ins[0], w.ints(gone)]) if gone else w.op("Identity", ins)


CONVERTERS |= {
    "gather": _gather, "scatter_add": _scatter_add, "one_hot": _one_hot,
    "squeeze": _squeeze,
    "unsqueeze": lambda w, n, ins, ts: w.op("Unsqueeze", [ins[0], w.ints([n.attrs["axis"] % len(n.shape)])]),
    "var": _variance(root=False), "std": _variance(root=True),
    "cumsum": lambda w, n, ins, ts: w.op("CumSum", [ins[0], w.const(np.asarray(n.attrs["axis"], np.int64))],
                                         reverse=int(n.attrs["reverse"])),
}

# Ops without an ONNX counterpart, and why: exporting one is a FlowError
# naming the node and its line (an op registered from Python is refused too).
GRADIENT_OPS = ("attention_grad", "layernorm_grad", "rmsnorm_grad", "batchnorm_grad", "groupnorm_grad",
                "cross_entropy_grad", "nll_loss_grad", "conv_input_grad", "conv_weight_grad", "maxpool2d_grad",
                "maxpool2d_pick", "avgpool2d_grad", "adaptive_avgpool2d_grad", "topk_grad", "topk_pick",
                "softmax_grad", "log_softmax_grad", "gelu_grad")
REFUSED = {
    "randn_like": "draws flowgrad's own noise, which an ONNX model would draw otherwise",
    **{op: "computes a gradient (grad() put it in the model); ONNX has no counterpart of its kernel"
       for op in GRADIENT_OPS},
}


def inference_outputs(graph: Graph) -> list[str]:
    """The outputs that do not read inputs only the loss reads (the targets)."""
    from flowgrad.training.data import output_inputs

    _, targets = output_inputs(graph)
    target_ids = {graph.inputs[t] for t in targets}
    return [name for name, i in graph.outputs.items()
            if not {n.id for n in graph.needed_for([i])} & target_ids]


def to_model(graph: Graph, params: dict[str, np.ndarray], outputs: list[str] | None = None,
             dims: dict[int, tuple] | None = None):
    """The onnx ModelProto of `graph`'s forward pass to `outputs`. dims: each
    node's axes, those that follow the batch `Scaled` (batch_dims); without
    them the graph is written at its own sizes."""
    onnx = _onnx()
    from onnx import helper

    graph = unrolled(graph)   # the ids of `dims` are those of the unrolled graph (batch_dims unrolls alike)
    outputs = outputs if outputs is not None else inference_outputs(graph)
    unknown = [o for o in outputs if o not in graph.outputs]
    if unknown or not outputs:
        raise FlowError(f"cannot export {graph.name}: " + (f"no output {unknown[0]!r} (outputs: "
                        f"{', '.join(graph.outputs)})" if unknown else "it has no outputs to export"))
    needed = graph.needed_for([graph.outputs[o] for o in outputs])
    # a hidden input (dropout's train-mode switch and step) only train mode reads: not exported
    feeds = [n for n in needed if n.op == "input" and n.name in graph.inputs]
    w = Writer(onnx, graph, feeds, dims)
    names: dict[int, str] = {n.id: n.name for n in feeds}
    for node in needed:
        if node.op == "param":
            names[node.id] = w.const(np.asarray(params[node.name], _dt(node)), name=node.name)
        elif node.op == "const":
            names[node.id] = _const(w, node)
        elif node.op != "input":
            names[node.id] = _converter(graph, node)(w, node, [names.get(i) for i in node.inputs],
                                                     [graph.nodes[i].type for i in node.inputs])
    for o in outputs:
        w.nodes.append(helper.make_node("Identity", [names[graph.outputs[o]]], [o]))
    g = helper.make_graph(w.nodes, graph.name, [w.value_info(n.name, n) for n in feeds],
                          [w.value_info(o, graph.nodes[graph.outputs[o]]) for o in outputs], w.inits)
    opsets = [helper.make_opsetid("", OPSET)]
    # The lowest IR version the opset needs, not the installed onnx's newest:
    # an onnxruntime older than that onnx package still loads the file.
    model = helper.make_model(g, opset_imports=opsets, producer_name="flowgrad",
                              ir_version=helper.find_min_ir_version_for(opsets))
    onnx.checker.check_model(model)
    return model


def _converter(graph, node):
    convert = CONVERTERS.get(node.op)
    if convert is None:
        reason = REFUSED.get(node.op, "has no ONNX counterpart here")
        # the span places it (file:line:col, and the block call that expanded it)
        raise FlowError(f"cannot export {graph.name} to ONNX: op {node.op} (node {node.label}) {reason}",
                        node.span, hint="exported ops: " + ", ".join(sorted(CONVERTERS)))
    return convert


def _const(w, node) -> str:
    """A constant; one sized by the batch (holding one value: scaled_dims
    checks) is that value expanded to the fed size."""
    value = np.asarray(node.attrs["value"], _dt(node))
    if not w.scaled_axes(node.id):
        return w.const(value)
    return w.op("Expand", [w.const(value.reshape(-1)[:1].reshape(())), w.shape(node.id)])


def batch_dims(sess) -> dict[int, tuple] | None:
    """Each node's axes, those that follow the batch `Scaled`, keyed by the
    ids of the graph with its scans unrolled: the model is built again at one
    more row and the two graphs compared. None for a model whose batch size
    is not a config key (it exports at its own sizes)."""
    from flowgrad.training.infer import FixedBatchError, batch_key, batch_size

    try:
        key = batch_key(sess.model, sess.graph, sess.plan.dtype)
    except FixedBatchError:
        return None
    b = batch_size(sess.graph)
    probe = sess.model.with_config(**{key: b + 1}).build(sess.plan.dtype)
    return scaled_dims(unrolled(sess.graph), unrolled(probe), b)


def export(sess, path, outputs: list[str] | None = None, dynamic_batch: bool = True) -> list[str]:
    """Write `sess`'s forward graph with its params to `path`, its batch
    dimension symbolic unless `dynamic_batch` is False; returns the exported
    output names."""
    from flowgrad.training.checkpoint import write_atomic

    if not isinstance(dynamic_batch, bool):
        raise FlowError(f"dynamic_batch must be True or False, got {dynamic_batch!r}")
    if any(n.dtype == "bf16" for n in sess.graph.nodes):
        raise FlowError("this session computes in bf16 (dtype='mixed'), which the ONNX export does not write",
                        hint="export its checkpoint with `flowgrad export` (f32), or compile with mixed='f16'")
    model = to_model(sess.graph, sess.params, outputs, batch_dims(sess) if dynamic_batch else None)
    try:
        write_atomic(path, model.SerializeToString())
    except OSError as e:
        raise FlowError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    return [o.name for o in model.graph.output]


def signature(path) -> str:
    """`inputs x: f32[batch,64]; outputs logits: f32[batch,10]` of an exported file."""
    model = _onnx().load(str(path), load_external_data=False)
    kinds = {1: "f32", 10: "f16", 6: "i32"}

    def show(v):
        t = v.type.tensor_type
        dims = ",".join(d.dim_param or (str(d.dim_value) if d.HasField("dim_value") else "?") for d in t.shape.dim)
        return f"{v.name}: {kinds[t.elem_type]}[{dims}]"

    return (f"inputs {', '.join(show(v) for v in model.graph.input)}; "
            f"outputs {', '.join(show(v) for v in model.graph.output)}")
