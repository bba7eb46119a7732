"""Random ops (dropout, randn_like) and the counter-based generator they draw from.

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
3", SC'11): a random word is a pure function of (counter, key), so a mask
element needs no state and every path computes the same bits: numpy here,
dropout.comp on the device. Element i of a dropout node's mask at training
step s uses counter (i, s, 0, 0) and key (seed, stream); stream is the
node's id unless the call names one. In data-parallel training rank r
counts its elements from r * n (n: the elements of its own x), so its rows
of a batch-major x (batch outermost, as dropout's inputs are in practice)
get the mask one process draws for those rows of the global batch. A
predict larger than the batch runs in chunks, each from some row of the
feeds on: its elements count on from row * (n / x's leading dimension), so
each row draws what one pass over all the rows gives it, whatever the
chunking (a short last chunk runs on a model built at its own size, so
the offset is in rows, not in chunks).

The step, the seed, whether this step trains, the rank and the first row
reach the graph as one hidden i32[5] input, RNG_INPUT = [training, step,
seed, rank, row], that the session fills in every step: the graph path's
recorded command buffer reads them from a buffer, so train and eval steps,
every step's fresh mask and every chunk replay the same recording. A
training step is one that computes gradients or takes an optimizer update;
a forward-only step (evaluation, `flowgrad run`) is eval, where dropout is
the identity.

randn_like's element i uses counter (i, s, 1, 0) (the 1 keeps its words
apart from dropout's under a shared stream) and the same key, offsets and
step. Unlike dropout it samples in eval steps too, as torch.randn_like does:
a VAE or diffusion model generates from noise at inference. An eval step
reuses the last training step's counter, so evaluations between two training
steps draw the same noise; a predict call draws its own (predict_noise)."""
from __future__ import annotations

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.ops.define import defop
from flowgrad.ops.precision import narrow, wide
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import float_dtype

RNG_INPUT = "@rng"
RNG_TYPE = TensorType((5,), "i32")

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)


def philox4x32(counter, key, rounds: int = 10):
    """Philox4x32-10 of counters (4 uint32 arrays, broadcast together) under
    key (2 uint32): the 4 output words."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint32) for c in counter)
    c0, c1, c2, c3 = np.broadcast_arrays(c0, c1, c2, c3)
    k0, k1 = np.uint32(key[0]), np.uint32(key[1])
    with np.errstate(over="ignore"):
        for r in range(rounds):
            if r:
                k0, k1 = k0 + _W0, k1 + _W1
            p0, p1 = _M0 * c0.astype(np.uint64), _M1 * c2.astype(np.uint64)
            hi0, lo0 = (p0 >> np.uint64(32)).astype(np.uint32), p0.astype(np.uint32)
            hi1, lo1 = (p1 >> np.uint64(32)).astype(np.uint32), p1.astype(np.uint32)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def rng_feed(training: bool, step: int, seed: int, rank: int = 0, row: int = 0) -> np.ndarray:
    return np.array([int(training), step & 0x7FFFFFFF, seed & 0x7FFFFFFF, rank, row], np.int32)


def predict_noise(seed: int, call: int) -> tuple[int, int]:
    """(step, seed) words for the noise of a session's `call`-th predict
    (1-based) when the session is seeded `seed`: a key of its own, mixed from
    the seed by Philox, keeps every predict's noise apart from every training
    and evaluation step's (which use the seed itself), and the call number
    counts in the step word."""
    words = philox4x32((seed & 0xFFFFFFFF, seed >> 32, 2, 0), (0x9E3779B9, 0x7F4A7C15))
    return call, int(words[0]) & 0x7FFFFFFF


def drop_threshold(p: float) -> int:
    """An element is kept when the top 24 bits of its word are >= this."""
    return min(int(round(p * (1 << 24))), 1 << 24)


def keep_scale(p: float) -> float:
    return 0.0 if p >= 1.0 else float(np.float32(1.0 / (1.0 - p)))


def dropout_mask(shape, p: float, step: int, seed: int, stream: int, rank: int = 0, row: int = 0) -> np.ndarray:
    """True where an element is kept."""
    word = philox4x32((_counters(shape, rank, row), step, 0, 0), (seed, stream))[0]
    return ((word >> np.uint32(8)) >= drop_threshold(p)).reshape(shape)


def row_length(shape) -> int:
    """The elements of one index of the leading axis (all of them for a scalar)."""
    n = int(np.prod(shape))
    return n // shape[0] if len(shape) and shape[0] else n


def _counters(shape, rank: int, row: int) -> np.ndarray:
    """Element i's first counter word: rank * n + row * row_length + i,
    wrapping as the shaders' uint does."""
    n = int(np.prod(shape))
    first = np.uint32((rank * n + row * row_length(shape)) & 0xFFFFFFFF)
    with np.errstate(over="ignore"):
        return np.arange(n, dtype=np.uint32) + first


def normal_noise(shape, step: int, seed: int, stream: int, rank: int = 0, row: int = 0) -> np.ndarray:
    """Standard normal float64 noise: Box-Muller on the first two Philox words
    of each element, each word's top 24 bits a uniform (the first in (0, 1],
    so its log is finite: |noise| <= 5.8)."""
    w0, w1, _, _ = philox4x32((_counters(shape, rank, row), step, 1, 0), (seed, stream))
    u1 = ((w0 >> np.uint32(8)).astype(np.float64) + 1.0) * 2.0**-24
    u2 = (w1 >> np.uint32(8)).astype(np.float64) * 2.0**-24
    return (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)).reshape(shape)


# ---------------------------------------------------------------- dropout


def _expand(builder, ins, attrs):
    if len(ins) == 2 and attrs["stream"] is not None and is_rng(builder, ins[1]):
        return ins, attrs   # a gradient's dropout: its forward's random state and stream, so its mask
    if len(ins) != 1:
        raise OpTypeError("takes one tensor, x; its random state is flowgrad's own")
    rng = builder.hidden_input(RNG_INPUT, RNG_TYPE)
    if attrs["stream"] is None:
        attrs = attrs | {"stream": builder.next_id()}
    return ins + [rng], attrs


def is_rng(builder, node_id) -> bool:
    """Whether the node is the random state input the build adds."""
    node = builder.graph.nodes[node_id]
    return node.op == "input" and node.name == RNG_INPUT


def _infer(ins, attrs):
    if not 0.0 <= attrs["p"] <= 1.0:
        raise OpTypeError(f"p={attrs['p']} must be in [0, 1]")
    return _check_rng(ins, attrs)


def _check_rng(ins, attrs):
    """x, the random state, and the stream: a 32-bit word of Philox's key."""
    float_dtype(ins[0], "x")
    stream = attrs["stream"]
    if stream is not None and not 0 <= stream < 2**32:
        raise OpTypeError(f"stream={stream} must be in [0, 2^32)")
    # one input: the call as written, checked before the build adds the random state
    if len(ins) > 2 or (len(ins) == 2 and ins[1] != RNG_TYPE):
        raise OpTypeError(f"its second input is its random state, {RNG_TYPE} (added when the model is built), "
                          f"got {ins[1]}")
    return ins[0]


def _forward(ins, attrs):
    """x times each element's factor; the identity in eval, and in a call
    with no random state (as written, before the build adds it)."""
    x = ins[0]
    if len(ins) < 2 or not int(ins[1][0]):
        return x.copy()
    _training, step, seed, rank, row = (int(v) for v in ins[1])
    mask = dropout_mask(x.shape, attrs["p"], step, seed, attrs["stream"] or 0, rank, row)
    factor = np.where(mask, np.float32(keep_scale(attrs["p"])), np.float32(0.0))
    return narrow(wide(x) * factor.astype(wide(x).dtype), x)


def _grad(g, ins, out, attrs):
    """The same mask and scale on g: the mask is a function of the random
    state, the stream and the element's place (the same shape for g as for
    x), so a dropout of g with the forward's random state draws it again."""
    return [g.e.op("dropout", g, *ins[1:], p=attrs["p"], stream=attrs["stream"])] + [None] * (len(ins) - 1)


dropout = defop(
    "dropout", (Arg("x"), Arg("p", "attr", 0.5, (float, int)), Arg("stream", "attr", None, (int, type(None))),
                Arg("rng", "tensor", None)),
    _infer, _forward, grad=_grad, expand=_expand, nondiff=(1,),
    doc="in training steps, zero each element with probability p and scale the rest by 1/(1-p); "
        "the identity in eval")

# ---------------------------------------------------------------- randn_like


def _randn_forward(ins, attrs):
    """A call with no random state (as written, before the build adds it)
    draws as step 0 of seed 0."""
    x, rng = ins[0], (ins[1] if len(ins) > 1 else np.zeros(RNG_TYPE.shape, np.int32))
    _training, step, seed, rank, row = (int(v) for v in rng)
    noise = normal_noise(x.shape, step, seed, attrs["stream"] or 0, rank, row)
    return narrow(noise.astype(wide(x).dtype), x)   # f16 rounds through f32, as the kernel stores it


randn_like = defop(
    "randn_like", (Arg("x"), Arg("stream", "attr", None, (int, type(None))), Arg("rng", "tensor", None)),
    _check_rng, _randn_forward, grad=lambda g, ins, out, at: [None] * len(ins), expand=_expand, nondiff=(0, 1),
    doc="standard normal noise of x's shape and dtype (x's values are not read; no gradient), a fresh draw "
        "every training step; eval steps sample too",
    samples=[Sample((((3, 5), "normal"), ((5,), "ints:3")), {"stream": 7})])
