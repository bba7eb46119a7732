"""Param initialisers named in `.flow` files: `param w: f32[a, b] = xavier()`.

Each param draws from its own generator, seeded by (model seed, param name),
so adding a param to a model does not change the others' initial values."""
from __future__ import annotations

import zlib

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.errors import FlowError
from flowgrad.graph import Graph


def _fans(shape, conv: bool = False):
    """(fan_in, fan_out). A matmul weight is [.., in, out] (x @ w); a
    convolution's is [out, in/groups, *kernel], whose kernel counts in both
    fans (as torch.nn.init computes them): its last two dims are the kernel's
    height and width, which alone gave 3x3 kernels a fan-in of 3."""
    if conv and len(shape) >= 3:
        field = int(np.prod(shape[2:]))
        return shape[1] * field, shape[0] * field
    if len(shape) < 2:
        n = shape[0] if shape else 1
        return n, n
    return shape[-2], shape[-1]


def _xavier(rng, shape, fans, gain=1.0):
    fan_in, fan_out = fans
    limit = gain * np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, shape)


def _kaiming(rng, shape, fans, gain=float(np.sqrt(2.0))):
    limit = gain * np.sqrt(3.0 / fans[0])
    return rng.uniform(-limit, limit, shape)


CONV_OPS = ("conv1d", "conv2d", "conv_transpose2d")


def conv_weights(graph: Graph) -> set[int]:
    """The params a convolution reads as its weight (through the casts of
    mixed precision)."""
    return {graph.uncast(n.inputs[1]) for n in graph.nodes if n.op in CONV_OPS and len(n.inputs) > 1}


# (rng, shape, fans, arguments a .flow file may give): fans come from how the graph uses the param
INITIALISERS = {
    "zeros": lambda rng, shape, fans: np.zeros(shape),
    "ones": lambda rng, shape, fans: np.ones(shape),
    "normal": lambda rng, shape, fans, mean=0.0, std=1.0: rng.normal(mean, std, shape),
    "uniform": lambda rng, shape, fans, low=0.0, high=1.0: rng.uniform(low, high, shape),
    "xavier": _xavier,
    "kaiming": _kaiming,
}


def init_text(node) -> str:
    """The initialiser as the model file calls it, arguments evaluated: normal(std=0.02)."""
    name, args = node.attrs["init"]
    return f"{name}({', '.join(f'{k}={v:g}' if isinstance(v, float) else f'{k}={v}' for k, v in args.items())})"


def check_initialisers(graph: Graph) -> None:
    """Each param's initialiser asked for no values, with the fans the graph
    gives it: numpy checks the arguments before it draws, so what it would
    refuse in init_params (a range so wide that high - low overflows) is
    refused when the model loads."""
    conv = conv_weights(graph)
    for name, nid in graph.params.items():
        node = graph.nodes[nid]
        init_name, kwargs = node.attrs["init"]
        try:
            INITIALISERS[init_name](np.random.default_rng(0), (0,), _fans(node.shape, nid in conv), **kwargs)
        except (ValueError, OverflowError) as err:
            raise FlowError(f"param {name}: numpy refuses {init_text(node)}: {err}", node.span) from None


def init_params(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    out = {}
    conv = conv_weights(graph)
    for name, nid in graph.params.items():
        node = graph.nodes[nid]
        init_name, kwargs = node.attrs["init"]
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        value = INITIALISERS[init_name](rng, node.shape, _fans(node.shape, nid in conv), **kwargs)
        out[name] = np.asarray(value, dtype=NUMPY_DTYPE[node.dtype])
    return out
