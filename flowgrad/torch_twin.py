"""A PyTorch twin of a flowgrad graph: the same dataflow, node by node, as
torch ops, so `flowgrad bench --compare torch` can time PyTorch on whatever
model a .flow file describes, and check first that the twin computes what
flowgrad computes (same params, same feeds, same loss).

PyTorch is an optional extra: `pip install 'flowgrad[torch]'`."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.errors import FlowError
from flowgrad.graph import Graph
from flowgrad.ops.random import RNG_INPUT
from flowgrad.ops.registry import get_op
from flowgrad.ops.scan import run_steps


def require_torch():
    try:
        import torch
    except ImportError:
        raise FlowError("comparing with PyTorch needs torch", hint="pip install 'flowgrad[torch]'") from None
    return torch


def _dtypes(torch):
    return {"f32": torch.float32, "f16": torch.float16, "i32": torch.int32}


def _axes(x, axis):
    if axis is None:
        return tuple(range(x.dim()))
    return tuple(axis) if isinstance(axis, (list, tuple)) else (axis,)


def _reduce(name):
    def run(torch, node, ins, at):
        (x,) = ins
        if at["axis"] is None and not at["keepdims"]:
            return getattr(torch, name)(x)
        return getattr(torch, name)(x, dim=_axes(x, at["axis"]), keepdim=at["keepdims"])
    return run


def _named(counterpart: str):
    """The rule of an op whose record names its PyTorch function (`torch.abs`,
    `F.relu`): that function of the node's tensor inputs."""
    module, _, path = counterpart.partition(".")

    def run(torch, node, ins, at):
        fn = torch.nn.functional if module == "F" else torch
        for name in path.split("."):   # torch.Tensor.detach: a method, by its class
            fn = getattr(fn, name)
        return fn(*ins)
    return run


def _slice(torch, node, ins, at):
    (x,) = ins
    index = [slice(None)] * x.dim()
    index[at["axis"]] = slice(at["start"], at["stop"])
    return x[tuple(index)]


def _attention(torch, node, ins, at):
    """flowgrad's [batch, seq, heads*dh] layout around scaled_dot_product_attention."""
    q, k, v, *mask = ins
    batched = q.dim() == 3
    if not batched:
        q, k, v = q[None], k[None], v[None]
    b, sq, d = q.shape
    heads = at["heads"]

    def split(x):
        return x.reshape(b, x.shape[1], heads, d // heads).transpose(1, 2)

    attn_mask = None
    if mask:
        m = mask[0]
        attn_mask = m != 0 if m.dtype == torch.int32 else m
    causal = bool(at["causal"])
    if causal and attn_mask is not None:   # SDPA takes is_causal only without a mask
        keep = torch.ones(sq, k.shape[1], dtype=torch.bool, device=q.device).tril()
        attn_mask = attn_mask & keep if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~keep, -math.inf)
        causal = False
    out = torch.nn.functional.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=attn_mask,
                                                           is_causal=causal)
    out = out.transpose(1, 2).reshape(b, sq, d)
    return out if batched else out[0]


def _attention_grad(torch, node, ins, at):
    """On the math kernels: the ones PyTorch differentiates again."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, _out, g, *mask = ins
    with sdpa_kernel(SDPBackend.MATH):
        grads = _vjp(torch, lambda q, k, v: _attention(torch, node, [q, k, v, *mask], at), [q, k, v], [0, 1, 2], g)
    return torch.cat([d.reshape(-1) for d in grads])


def _trailing(ins):
    """The trailing axes a norm's weight spans."""
    return tuple(range(ins[0].dim() - ins[1].dim(), ins[0].dim()))


def _rmsnorm(torch, node, ins, at):
    x, w = ins
    eps = torch.finfo(x.dtype).eps if at["eps"] is None else at["eps"]
    return x * torch.rsqrt((x * x).mean(dim=_trailing(ins), keepdim=True) + eps) * w


def _classes_last(x, axis):
    """[rows, C] with the class axis last, as torch's losses take it flattened."""
    return x.movedim(axis, -1).reshape(-1, x.shape[axis])


def _class_loss(fn, smoothing):
    def run(torch, node, ins, at):
        scores, targets, *weight = ins
        kw = {"label_smoothing": at["label_smoothing"]} if smoothing else {}
        return fn(torch)(_classes_last(scores, at["axis"]), targets.reshape(-1).long(),
                         weight=weight[0].detach() if weight else None,  # no gradient, in either
                         ignore_index=at["ignore_index"], **kw)
    return run


def _class_loss_grad(fn, smoothing):
    """The loss's gradient for its scores, from the loss's gradient (the scores' slot is the first input)."""
    rule = _class_loss(fn, smoothing)

    def run(torch, node, ins, at):
        scores, targets, g, *weight = ins
        return _vjp(torch, lambda s: rule(torch, node, [s, targets, *weight], at), [scores], [0], g)[0]
    return run


def _dropout(torch, node, ins, at):
    """Training follows the random-state input; torch draws its own mask, so
    only an eval step (or p = 0) computes what flowgrad computes."""
    x, training = ins
    return torch.nn.functional.dropout(x, at["p"], training=bool(training))


def _randn_like(torch, node, ins, at):
    """torch's own noise, at torch's cost: flowgrad's draws are not torch's, so
    a check gives the twin flowgrad's (flowgrad_noise)."""
    return torch.randn_like(ins[0])


def flowgrad_noise(sess, twin_graph: Graph) -> dict[int, np.ndarray]:
    """What the randn_like nodes of sess's graph draw in an evaluation step
    now, by the op's own numpy rule, keyed by the ids of twin_graph's: its
    k-th randn_like is the k-th of sess's (a mixed-precision build numbers its
    nodes, and so its default streams, apart from the f32 build the twin runs)."""
    ours = [n for n in sess.graph.nodes if n.op == "randn_like"]
    theirs = [n for n in twin_graph.nodes if n.op == "randn_like"]
    if not ours:
        return {}
    state, op = sess.eval_random_state(), get_op("randn_like")
    # x's values are not read: an empty array of its shape and dtype stands in
    return {t.id: op.forward([np.empty(n.shape, NUMPY_DTYPE[n.dtype]), state], n.attrs)
            for n, t in zip(ours, theirs)}


def _vjp(torch, forward, ins, wrt, g):
    """The gradients of forward(*ins) for the inputs at `wrt`, given the
    output's gradient g, as a graph that can be differentiated again: a
    backward op's twin. An input that needs no gradient stands in as a leaf."""
    xs = [x if i not in wrt or x.requires_grad else x.detach().requires_grad_() for i, x in enumerate(ins)]
    with torch.enable_grad():
        y = forward(*xs)
        grads = torch.autograd.grad(y, [xs[i] for i in wrt], g, create_graph=True, allow_unused=True)
    return [torch.zeros_like(xs[i]) if d is None else d for i, d in zip(wrt, grads)]


def _norm_grad(params):
    """layernorm_grad's twin (params 2: dx, dw, db) or rmsnorm_grad's (1: dx, dw), flat."""
    def run(torch, node, ins, at):
        x, w, g = ins
        if params == 2:
            def norm(x, w, b):
                return torch.nn.functional.layer_norm(x, tuple(w.shape), w, b, at["eps"])
            pair = [x, w, torch.zeros_like(w)]
        else:
            def norm(x, w):
                return _rmsnorm(torch, node, [x, w], at)
            pair = [x, w]
        return torch.cat([d.reshape(-1) for d in _vjp(torch, norm, pair, list(range(len(pair))), g)])
    return run


def _batchnorm_grad(torch, node, ins, at):
    """Batch statistics in training (as F.batch_norm's, which then updates
    copies of the running ones here), the running ones in eval."""
    x, w, mean, var, g, training = ins

    def norm(x, w, b):
        return torch.nn.functional.batch_norm(x, mean.clone(), var.clone(), w, b, bool(training), 0.0, at["eps"])
    return torch.cat([d.reshape(-1) for d in _vjp(torch, norm, [x, w, torch.zeros_like(w)], [0, 1, 2], g)])


def _groupnorm_grad(torch, node, ins, at):
    x, w, g = ins

    def norm(x, w, b):
        return torch.nn.functional.group_norm(x, at["groups"], w, b, at["eps"])
    return torch.cat([d.reshape(-1) for d in _vjp(torch, norm, [x, w, torch.zeros_like(w)], [0, 1, 2], g)])


def _conv_grad(role):
    """conv_input_grad's twin (role 0: ins g, weight) or conv_weight_grad's (role 1: ins g, x)."""
    def run(torch, node, ins, at):
        g, other = ins
        fn = torch.nn.functional.conv1d if len(node.shape) == 3 else torch.nn.functional.conv2d
        zeros = g.new_zeros(node.shape)   # the convolution is linear in it: any value does
        pair = [zeros, other] if role == 0 else [other, zeros]
        conv = {k: at[k] for k in ("stride", "padding", "dilation", "groups")}
        return _vjp(torch, lambda x, w: fn(x, w, **conv), pair, [role], g)[0]
    return run


def _pool_grad(name, *keys):
    """A pooling's gradient for an x of the node's shape (maxpool2d's at x itself)."""
    def run(torch, node, ins, at):
        fn = getattr(torch.nn.functional, name)
        x, g = ins if name == "max_pool2d" else (ins[0].new_zeros(node.shape), ins[0])
        return _vjp(torch, lambda x: fn(x, **{k: at[k] for k in keys}), [x], [0], g)[0]
    return run


def _max_pick(torch, node, ins, at):
    x, t = ins
    _, idx = torch.nn.functional.max_pool2d(x, at["kernel_size"], at["stride"], at["padding"], return_indices=True)
    return t.flatten(2).gather(2, idx.flatten(2)).view(idx.shape)


def _batchnorm(torch, node, ins, at):
    """Running statistics updated in place in training, as flowgrad's state."""
    x, w, b, mean, var, training = ins
    return torch.nn.functional.batch_norm(x, mean, var, w, b, bool(training), at["momentum"], at["eps"])


def _f(name, *keys):
    """torch.nn.functional.name(inputs..., key=attr...)."""
    return lambda torch, node, ins, at: getattr(torch.nn.functional, name)(*ins, **{k: at[k] for k in keys})


def _as_node_dtype(fn):
    return lambda torch, node, ins, at: fn(torch, node, ins, at).to(_dtypes(torch)[node.dtype])


def _topk_indices(torch, node, ins, at):
    """A stable sort's first k: flowgrad's ties go to the lower index, and
    torch.topk leaves the order of ties open."""
    order = torch.sort(ins[0], dim=at["axis"], descending=True, stable=True).indices
    return order.narrow(at["axis"], 0, at["k"])


def _compare(name):
    return _as_node_dtype(lambda torch, node, ins, at: getattr(torch, name)(ins[0], ins[1]))


def _scan(torch, node, ins, at):
    """The cell's nodes by their own rules, step by step; the results packed as flowgrad packs them."""
    body, steps = at["body"], at["steps"]
    xs, carries, captured = body.split(ins)

    def step(i, carries):
        vals = dict(zip(body.inputs, [x[i] for x in xs] + carries + captured))
        for n in body.graph.nodes:
            if n.op == "const":
                vals[n.id] = torch.tensor(np.asarray(n.attrs["value"]), device=ins[0].device)
            elif n.id not in vals:
                vals[n.id] = rule_for(n.op)(torch, n, [vals[k] for k in n.inputs], n.attrs)
        return [vals[o] for o in body.outputs]

    ys, kept, last = run_steps(body, steps, at["reverse"], carries, step)
    parts = [torch.stack(y) for y in ys] + ([torch.stack(c) for c in kept] if at["history"] else last)
    return torch.cat([p.reshape(-1) for p in parts])


def _unpack(torch, node, ins, at):
    n = math.prod(at["shape"])
    return ins[0].reshape(-1)[at["offset"]:at["offset"] + n].reshape(tuple(at["shape"]))


LOWER = {
    **{n: _named(f"torch.{n}") for n in ("matmul", "erf")},
    **{n: _reduce(f) for n, f in (("sum", "sum"), ("mean", "mean"), ("max", "amax"), ("min", "amin"))},
    **{n: _compare(n) for n in ("eq", "ne", "lt", "le", "gt", "ge")},
    # torch.logsumexp has no all-axes default: name them
    "logsumexp": lambda torch, node, ins, at: torch.logsumexp(ins[0], dim=_axes(ins[0], at["axis"]),
                                                              keepdim=at["keepdims"]),
    "where": lambda torch, node, ins, at: torch.where(ins[0] != 0, ins[1], ins[2]),
    "clamp_min": lambda torch, node, ins, at: torch.clamp(ins[0], min=at["min"]),
    "clamp_max": lambda torch, node, ins, at: torch.clamp(ins[0], max=at["max"]),
    "gelu": lambda torch, node, ins, at: torch.nn.functional.gelu(ins[0], approximate=at["approximate"]),
    "gelu_grad": lambda torch, node, ins, at: torch.ops.aten.gelu_backward(torch.ones_like(ins[0]), ins[0]),
    "softplus": _f("softplus", "beta", "threshold"),
    "leaky_relu": _f("leaky_relu", "negative_slope"),
    "elu": _f("elu", "alpha"),
    "pow": lambda torch, node, ins, at: torch.pow(ins[0], at["exponent"]),
    "softmax": lambda torch, node, ins, at: torch.softmax(ins[0], dim=at["axis"]),
    "log_softmax": lambda torch, node, ins, at: torch.log_softmax(ins[0], dim=at["axis"]),
    "argmax": _as_node_dtype(lambda torch, node, ins, at: torch.argmax(ins[0], dim=at["axis"],
                                                                      keepdim=at["keepdims"])),
    "topk": lambda torch, node, ins, at: torch.topk(ins[0], at["k"], dim=at["axis"]).values,
    "topk_indices": _as_node_dtype(_topk_indices),
    "topk_grad": lambda torch, node, ins, at: torch.zeros_like(ins[0]).scatter(
        at["axis"], _topk_indices(torch, node, ins[:1], at), ins[1]),
    "topk_pick": lambda torch, node, ins, at: torch.gather(ins[1], at["axis"], _topk_indices(torch, node, ins[:1], at)),
    "layernorm": lambda torch, node, ins, at: torch.nn.functional.layer_norm(
        ins[0], tuple(ins[1].shape), ins[1], ins[2], at["eps"]),
    "rmsnorm": _rmsnorm,
    "softmax_grad": lambda torch, node, ins, at: ins[0] * (ins[1] - (ins[1] * ins[0]).sum(at["axis"], keepdim=True)),
    "log_softmax_grad": lambda torch, node, ins, at: ins[1] - ins[0].exp() * ins[1].sum(at["axis"], keepdim=True),
    "layernorm_grad": _norm_grad(2),
    "rmsnorm_grad": _norm_grad(1),
    "batchnorm": _batchnorm,
    "groupnorm": lambda torch, node, ins, at: torch.nn.functional.group_norm(ins[0], at["groups"], ins[1], ins[2],
                                                                             at["eps"]),
    "batchnorm_grad": _batchnorm_grad,
    "groupnorm_grad": _groupnorm_grad,
    "dropout": _dropout,
    "randn_like": _randn_like,
    "conv2d": _f("conv2d", "stride", "padding", "dilation", "groups"),
    "conv1d": _f("conv1d", "stride", "padding", "dilation", "groups"),
    "conv_transpose2d": _f("conv_transpose2d", "stride", "padding", "output_padding", "groups", "dilation"),
    "conv_input_grad": _conv_grad(0),
    "conv_weight_grad": _conv_grad(1),
    "maxpool2d": _f("max_pool2d", "kernel_size", "stride", "padding"),
    "avgpool2d": _f("avg_pool2d", "kernel_size", "stride", "padding", "count_include_pad"),
    "adaptive_avgpool2d": _f("adaptive_avg_pool2d", "output_size"),
    "maxpool2d_grad": _pool_grad("max_pool2d", "kernel_size", "stride", "padding"),
    "maxpool2d_pick": _max_pick,
    "avgpool2d_grad": _pool_grad("avg_pool2d", "kernel_size", "stride", "padding", "count_include_pad"),
    "adaptive_avgpool2d_grad": _pool_grad("adaptive_avg_pool2d", "output_size"),
    "flatten": lambda torch, node, ins, at: torch.flatten(ins[0], at["start_dim"], at["end_dim"]),
    "pad": lambda torch, node, ins, at: torch.nn.functional.pad(ins[0], tuple(at["pad"]), value=at["value"]),
    "embedding": lambda torch, node, ins, at: torch.nn.functional.embedding(ins[0].long(), ins[1]),
    "embedding_grad": lambda torch, node, ins, at: ins[1].new_zeros(node.shape).index_add(
        0, ins[0].reshape(-1).long(), ins[1].reshape(-1, node.shape[-1])),
    "reshape": lambda torch, node, ins, at: ins[0].reshape(node.shape),
    "broadcast_to": lambda torch, node, ins, at: ins[0].broadcast_to(node.shape).clone(),
    "transpose": lambda torch, node, ins, at: ins[0].transpose(at["dim0"], at["dim1"]),
    "permute": lambda torch, node, ins, at: ins[0].permute(*at["dims"]),
    "slice": _slice,
    "concat": lambda torch, node, ins, at: torch.cat(ins, dim=at["axis"]),
    "cast": lambda torch, node, ins, at: ins[0].to(_dtypes(torch)[node.dtype]),
    "attention": _attention,
    "attention_grad": _attention_grad,
    "mse_loss": _f("mse_loss"),
    "l1_loss": _f("l1_loss"),
    "huber_loss": _f("huber_loss", "delta"),
    "bce_with_logits": _f("binary_cross_entropy_with_logits"),
    "cross_entropy": _class_loss(lambda torch: torch.nn.functional.cross_entropy, smoothing=True),
    "nll_loss": _class_loss(lambda torch: torch.nn.functional.nll_loss, smoothing=False),
    "cross_entropy_grad": _class_loss_grad(lambda torch: torch.nn.functional.cross_entropy, smoothing=True),
    "nll_loss_grad": _class_loss_grad(lambda torch: torch.nn.functional.nll_loss, smoothing=False),
    "scan": _scan,
    "unpack": _unpack,
}
LOWER |= {
    "squeeze": lambda torch, node, ins, at: (ins[0].squeeze() if at["axis"] is None else
                                             ins[0].squeeze(tuple(_axes(ins[0], at["axis"])))),
    "unsqueeze": lambda torch, node, ins, at: ins[0].unsqueeze(at["axis"]),
    "var": lambda torch, node, ins, at: torch.var(ins[0], dim=_axes(ins[0], at["axis"]), correction=at["correction"],
                                                  keepdim=at["keepdims"]),
    "std": lambda torch, node, ins, at: torch.std(ins[0], dim=_axes(ins[0], at["axis"]), correction=at["correction"],
                                                  keepdim=at["keepdims"]),
    "cumsum": lambda torch, node, ins, at: (ins[0].flip(at["axis"]).cumsum(at["axis"]).flip(at["axis"])
                                            if at["reverse"] else ins[0].cumsum(at["axis"])),
    "gather": lambda torch, node, ins, at: torch.gather(ins[0], at["axis"], ins[1].long()),
    "scatter_add": lambda torch, node, ins, at: ins[0].scatter_add(at["axis"], ins[1].long(), ins[2]),
    "one_hot": lambda torch, node, ins, at: torch.nn.functional.one_hot(ins[0].long(), at["n"]).to(
        _dtypes(torch)[node.dtype]),
}


# What each op is in PyTorch (the doc's op table shows it): the call LOWER makes,
# F. for torch.nn.functional. An op whose record names it (Op.torch) is not listed.
COUNTERPART = {
    **{n: f"torch.{n}" for n in ("matmul", "where", "erf", "sum", "mean", "softmax",
                                 "log_softmax", "argmax", "eq", "ne", "lt", "le", "gt", "ge", "reshape", "transpose",
                                 "broadcast_to",
                                 "permute", "flatten")},
    **{n: f"F.{n}" for n in ("gelu", "softplus", "leaky_relu", "elu", "dropout", "conv2d", "conv1d", "conv_transpose2d", "pad", "embedding", "mse_loss",
                             "l1_loss", "huber_loss", "cross_entropy", "nll_loss")},
    "layernorm": "F.layer_norm", "groupnorm": "F.group_norm", "rmsnorm": "F.rms_norm", "batchnorm": "F.batch_norm",
    "max": "torch.amax", "min": "torch.amin", "randn_like": "torch.randn_like", "logsumexp": "torch.logsumexp",
    "pow": "torch.pow", "clamp": "torch.clamp", "clamp_min": "torch.clamp(min=)",
    "clamp_max": "torch.clamp(max=)", "topk": "torch.topk(...).values", "topk_indices": "torch.topk(...).indices",
    "maxpool2d": "F.max_pool2d", "avgpool2d": "F.avg_pool2d", "adaptive_avgpool2d": "F.adaptive_avg_pool2d",
    "bce_with_logits": "F.binary_cross_entropy_with_logits", "slice": "x[..., start:stop]", "concat": "torch.cat",
    "cast": "Tensor.to(dtype)", "attention": "F.scaled_dot_product_attention",
    "embedding_grad": "Tensor.index_add", "topk_grad": "Tensor.scatter", "topk_pick": "torch.gather",
    "softmax_grad": "torch._softmax_backward_data", "log_softmax_grad": "torch._log_softmax_backward_data",
    "gelu_grad": "torch.ops.aten.gelu_backward",
    "conv_input_grad": "torch.nn.grad.conv2d_input", "conv_weight_grad": "torch.nn.grad.conv2d_weight",
    **{f"{n}_grad": f"torch.autograd.grad(F.{t})" for n, t in (
        ("maxpool2d", "max_pool2d"), ("avgpool2d", "avg_pool2d"), ("adaptive_avgpool2d", "adaptive_avg_pool2d"))},
    "maxpool2d_pick": "F.max_pool2d(return_indices=True)",
    "layernorm_grad": "torch.autograd.grad(F.layer_norm)", "rmsnorm_grad": "torch.autograd.grad(F.rms_norm)",
    "batchnorm_grad": "torch.autograd.grad(F.batch_norm)", "groupnorm_grad": "torch.autograd.grad(F.group_norm)",
    "cross_entropy_grad": "torch.autograd.grad(F.cross_entropy)", "nll_loss_grad": "torch.autograd.grad(F.nll_loss)",
    "attention_grad": "torch.autograd.grad(F.scaled_dot_product_attention)",
}
COUNTERPART |= {"squeeze": "torch.squeeze", "unsqueeze": "torch.unsqueeze", "stack": "torch.stack",
                "var": "torch.var", "std": "torch.std", "cumsum": "torch.cumsum", "gather": "torch.gather",
                "scatter_add": "torch.scatter_add", "one_hot": "F.one_hot", "einsum": "torch.einsum",
                "maxpool1d": "F.max_pool1d", "avgpool1d": "F.avg_pool1d", "interpolate": "F.interpolate"}


def rule_for(op_name: str):
    """How a node of the op runs in PyTorch: its rule in LOWER, or the
    function its record names; None when it has neither."""
    if op_name in LOWER:
        return LOWER[op_name]
    named = get_op(op_name).torch
    return _named(named) if named else None


def counterpart(op_name: str) -> str | None:
    """What the op is in PyTorch, as the docs' op table shows it."""
    return COUNTERPART.get(op_name) or get_op(op_name).torch or None


def _with_cells(graph: Graph):
    """The graph's nodes and those of its scans' cells."""
    for n in graph.nodes:
        yield n
        if n.op == "scan":
            yield from _with_cells(n.attrs["body"].graph)


def check_twin(graph: Graph) -> None:
    """Refuse a graph with an op the twin has no rule for."""
    missing = sorted({n.op for n in _with_cells(graph) if n.op not in ("input", "param", "const")
                      and rule_for(n.op) is None})
    if missing:
        raise FlowError(f"{graph.name}: no PyTorch twin for op(s) {', '.join(missing)}",
                        hint="flowgrad.torch_twin.LOWER lists the ops it maps")


class TorchTwin:
    """graph's forward as torch ops on `device`, params initialised from
    `params` (numpy arrays, e.g. a flowgrad session's get_params()). `state`
    declarations (running statistics) are tensors without gradients that
    the ops update in place. The random-state input flowgrad feeds itself
    becomes the step's kind: forward(training=...) (a step is training by
    default, as a flowgrad step that computes gradients)."""

    def __init__(self, graph: Graph, params: dict[str, np.ndarray], device: str = "cpu"):
        torch = require_torch()
        check_twin(graph)
        self.torch, self.graph, self.device = torch, graph, device
        trainable = graph.trainable()
        self.params = {name: torch.tensor(np.asarray(params[name]), device=device).requires_grad_(name in trainable)
                       for name in graph.params}
        self.consts = {n.id: torch.tensor(np.asarray(n.attrs["value"]), device=device)
                       for n in graph.nodes if n.op == "const"}
        self._steps = [(n, None if n.op in ("input", "param", "const") else rule_for(n.op), n.attrs)  # attrs are complete
                       for n in graph.nodes]

    def feeds(self, feeds: dict[str, np.ndarray]) -> dict:
        return {name: self.torch.tensor(np.asarray(a), device=self.device) for name, a in feeds.items()}

    def forward(self, feeds: dict, training: bool = True, noise: dict | None = None) -> tuple:
        """(loss or None, {output name: tensor}) for torch-tensor feeds.
        noise: {node id: array} that those randn_like nodes give instead of
        torch's draws (flowgrad_noise)."""
        g, vals = self.graph, {}
        names = {i: name for name, i in g.inputs.items()} | {i: name for name, i in g.params.items()}
        for node, fn, at in self._steps:
            if node.op == "input" and node.name == RNG_INPUT:
                vals[node.id] = training
            elif node.op == "input":
                vals[node.id] = feeds[names[node.id]]
            elif node.op == "param":
                vals[node.id] = self.params[names[node.id]]
            elif node.op == "const":
                vals[node.id] = self.consts[node.id]
            elif noise and node.id in noise:
                vals[node.id] = self.torch.tensor(noise[node.id], device=self.device).to(
                    _dtypes(self.torch)[node.dtype])
            else:
                vals[node.id] = fn(self.torch, node, [vals[i] for i in node.inputs], at)
        return (vals[g.loss] if g.loss is not None else None), {name: vals[i] for name, i in g.outputs.items()}

    def step(self, feeds: dict):
        """Forward and backward; returns the loss tensor (grads on the params)."""
        for p in self.params.values():
            p.grad = None
        loss, _ = self.forward(feeds)
        loss.backward()
        return loss

    def grads(self) -> dict[str, np.ndarray]:
        return {name: (np.zeros(tuple(p.shape), np.float32) if p.grad is None else p.grad.detach().cpu().numpy())
                for name, p in self.params.items() if p.requires_grad}
