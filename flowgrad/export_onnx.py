"""ONNX export of a session's forward graph with its current params:
`sess.to_onnx(path)` and `flowgrad export MODEL --checkpoint C -o model.onnx`.

The exported graph computes the model's outputs that do not read the
targets (the loss and what depends on it are left out unless asked for), at
the session's batch size (export another size with `--set batch=N`). Params
are initializers; inputs and outputs keep their names. Opset 17, the first
with LayerNormalization. Each flowgrad op is written as the ONNX ops below;
an op missing from the table (an op registered from Python, say) is a
FlowError naming the node and its line. Needs the `onnx` package
(`pip install 'flowgrad[onnx]'`)."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.errors import FlowError
from flowgrad.graph import Graph

OPSET = 17


def _onnx():
    try:
        import onnx
    except ImportError:
        raise FlowError("ONNX export needs the onnx package: pip install 'flowgrad[onnx]' "
                        "(or pip install onnx)") from None
    return onnx


class Writer:
    """The ONNX nodes and initializers of one export, with fresh names."""

    def __init__(self, onnx):
        self.onnx = onnx
        self.nodes, self.inits, self.count = [], [], 0

    def name(self, hint: str = "t") -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def op(self, kind: str, inputs, **attrs) -> str:
        out = self.name(kind.lower())
        self.nodes.append(self.onnx.helper.make_node(kind, list(inputs), [out], **attrs))
        return out

    def const(self, value, dtype=None, name=None) -> str:
        name = name or self.name("c")
        self.inits.append(self.onnx.numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def ints(self, values) -> str:
        return self.const(np.asarray(list(values), np.int64))

    def scalar(self, value, like_dtype) -> str:
        return self.const(np.asarray(value, like_dtype))


def _axes(axis, ndim):
    if axis is None:
        return list(range(ndim))
    return [a % ndim for a in (axis if isinstance(axis, (list, tuple)) else [axis])]


def _dt(node):
    return NUMPY_DTYPE[node.dtype]


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
    return w.op("Reshape", [w.op("Transpose", [out], perm=[0, 2, 1, 3]), w.ints(ts[0].shape)])


def _class_loss(kind):
    """cross_entropy / nll_loss as ONNX's loss op (mean reduction, weight,
    ignore_index), which wants the classes on axis 1."""
    def convert(w, n, ins, ts):
        if n.attrs.get("label_smoothing"):   # cross_entropy has it, nll_loss does not
            raise FlowError(f"cannot export {n.op} (node {n.label}) to ONNX: label_smoothing has no ONNX "
                            "counterpart", n.span)
        x, targets, *weight = ins
        nd = len(ts[0].shape)
        axis = n.attrs["axis"] % nd
        if nd == 1:  # one row: [C] -> [1, C]
            x, targets = w.op("Unsqueeze", [x, w.ints([0])]), w.op("Unsqueeze", [targets, w.ints([0])])
        elif axis != 1:  # the targets' axes are the others, in order, as ONNX wants them
            rest = [d for d in range(nd) if d != axis]
            x = w.op("Transpose", [x], perm=[rest[0], axis, *rest[1:]])
        return w.op(kind, [x, w.op("Cast", [targets], to=7), *weight], reduction="mean",
                    ignore_index=int(n.attrs["ignore_index"]))
    return convert


def _mse(w, n, ins, ts):
    diff = w.op("Sub", ins)
    return w.op("ReduceMean", [w.op("Mul", [diff, diff])], keepdims=0)


def _cast(w, n, ins, ts):
    return w.op("Cast", ins, to={"f32": 1, "f16": 10, "i32": 6}[n.dtype])


def _compare(kind, negate=False):
    """A comparison: 1 or 0 in the operands' dtype, as flowgrad has no bool."""
    def convert(w, n, ins, ts):
        out = w.op(kind, ins)
        return _cast(w, n, [w.op("Not", [out]) if negate else out], ts)
    return convert


def _where(w, n, ins, ts):
    cond, a, b = ins
    return w.op("Where", [w.op("Cast", [cond], to=9), a, b])   # 9: bool, true where nonzero


CONVERTERS = {
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
    "reshape": lambda w, n, ins, ts: w.op("Reshape", [ins[0], w.ints(n.shape)]),
    "broadcast_to": lambda w, n, ins, ts: w.op("Expand", [ins[0], w.ints(n.shape)]),
    "stop_gradient": lambda w, n, ins, ts: w.op("Identity", ins[:1]),
    "transpose": _transpose, "permute": _permute, "slice": _slice,
    "concat": lambda w, n, ins, ts: w.op("Concat", ins, axis=n.attrs["axis"] % len(n.shape)),
    "embedding": lambda w, n, ins, ts: w.op("Gather", [ins[1], ins[0]], axis=0),
    "layernorm": lambda w, n, ins, ts: w.op("LayerNormalization", ins, axis=-len(ts[1].shape),
                                            epsilon=float(n.attrs["eps"])),
    "rmsnorm": _rmsnorm,
    "attention": _attention,
    "where": _where, "eq": _compare("Equal"), "ne": _compare("Equal", negate=True), "lt": _compare("Less"),
    "le": _compare("LessOrEqual"), "gt": _compare("Greater"), "ge": _compare("GreaterOrEqual"),
    "cross_entropy": _class_loss("SoftmaxCrossEntropyLoss"), "nll_loss": _class_loss("NegativeLogLikelihoodLoss"),
    "mse_loss": _mse,
    "cast": _cast,
    # the export is the inference graph, where dropout is the identity (its hidden rng input is not exported)
    "dropout": lambda w, n, ins, ts: w.op("Identity", ins[:1]),
}


def inference_outputs(graph: Graph) -> list[str]:
    """The outputs that do not read inputs only the loss reads (the targets)."""
    from flowgrad.training.data import output_inputs

    _, targets = output_inputs(graph)
    target_ids = {graph.inputs[t] for t in targets}
    return [name for name, i in graph.outputs.items()
            if not {n.id for n in graph.needed_for([i])} & target_ids]


def to_model(graph: Graph, params: dict[str, np.ndarray], outputs: list[str] | None = None):
    """The onnx ModelProto of `graph`'s forward pass to `outputs`."""
    onnx = _onnx()
    from onnx import TensorProto, helper

    outputs = outputs if outputs is not None else inference_outputs(graph)
    unknown = [o for o in outputs if o not in graph.outputs]
    if unknown or not outputs:
        raise FlowError(f"cannot export {graph.name}: " + (f"no output {unknown[0]!r} (outputs: "
                        f"{', '.join(graph.outputs)})" if unknown else "it has no outputs to export"))
    elem = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16, "i32": TensorProto.INT32}
    w = Writer(onnx)
    needed = graph.needed_for([graph.outputs[o] for o in outputs])
    names: dict[int, str] = {}
    inputs = []
    for node in needed:
        if node.op == "input" and node.name not in graph.inputs:
            continue   # a hidden input (dropout's train-mode switch and step) only train mode reads
        if node.op == "input":
            names[node.id] = node.name
            inputs.append(helper.make_tensor_value_info(node.name, elem[node.dtype], list(node.shape)))
        elif node.op == "param":
            names[node.id] = w.const(np.asarray(params[node.name], _dt(node)), name=node.name)
        elif node.op == "const":
            names[node.id] = w.const(np.asarray(node.attrs["value"], _dt(node)))
        else:
            convert = CONVERTERS.get(node.op)
            if convert is None:
                # the span places it (file:line:col, and the block call that expanded it)
                raise FlowError(f"cannot export {graph.name} to ONNX: op {node.op} (node {node.label}) has no ONNX "
                                "counterpart here",
                                node.span,
                                hint="exported ops: " + ", ".join(sorted(CONVERTERS)))
            names[node.id] = convert(w, node, [names.get(i) for i in node.inputs],
                                     [graph.nodes[i].type for i in node.inputs])
    outs = []
    for o in outputs:
        node = graph.nodes[graph.outputs[o]]
        w.nodes.append(helper.make_node("Identity", [names[node.id]], [o]))
        outs.append(helper.make_tensor_value_info(o, elem[node.dtype], list(node.shape)))
    g = helper.make_graph(w.nodes, graph.name, inputs, outs, w.inits)
    opsets = [helper.make_opsetid("", OPSET)]
    # The lowest IR version the opset needs, not the installed onnx's newest:
    # an onnxruntime older than that onnx package still loads the file.
    model = helper.make_model(g, opset_imports=opsets, producer_name="flowgrad",
                              ir_version=helper.find_min_ir_version_for(opsets))
    onnx.checker.check_model(model)
    return model


def export(sess, path, outputs: list[str] | None = None) -> list[str]:
    """Write `sess`'s forward graph with its params to `path`; returns the
    exported output names."""
    from flowgrad.training.checkpoint import write_atomic

    model = to_model(sess.graph, sess.params, outputs)

    try:
        write_atomic(path, model.SerializeToString())
    except OSError as e:
        raise FlowError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    return [o.name for o in model.graph.output]
