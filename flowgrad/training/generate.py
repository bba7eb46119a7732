"""Sampling text from a language model trained on `text(...)`:
`flowgrad generate MODEL --checkpoint C --prompt "..." [--tokens N] [--temperature T] [--top-k K]`.

Each new token re-runs the whole window (the last `seq` tokens, no cache of
attention keys and values): slow for long windows, but it is the forward
pass that was trained. The window sits at positions 0..L-1 and the rest of
the row is padding, so the model must be causal (position i reads positions
up to i only), as a decoder with causal attention is; that is checked before
the first token, by padding with two different tokens and comparing."""
from __future__ import annotations

import itertools
import math

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.training.data import output_inputs
from flowgrad.training.metrics import predictions_first
from flowgrad.training.text import encode, pieces


def lm_io(graph) -> tuple[str, str, int]:
    """(token input, logits output, window length) of a language model."""
    feats, targets = output_inputs(graph)
    tokens = [n for n in feats if graph.nodes[graph.inputs[n]].dtype == "i32"
              and len(graph.nodes[graph.inputs[n]].shape) == 2]
    if len(tokens) != 1:
        raise FlowError(f"{graph.name} is not a language model that generate can drive: it needs one input of "
                        "token ids shaped [batch, seq] that its outputs read")
    t = graph.nodes[graph.inputs[tokens[0]]].type
    fits = [name for name, i in graph.outputs.items()
            if i not in graph.loss_ids() and len(graph.nodes[i].type.shape) == 3 and graph.nodes[i].type.shape[:2] == t.shape]
    # sampling from softmax(probs / T) would draw nearly uniformly
    fits = predictions_first(graph, fits, targets)
    if fits:
        return tokens[0], fits[0], t.shape[1]
    raise FlowError(f"{graph.name} has no output of next-token logits shaped [batch, seq, vocab]",
                    hint="declare it: `output logits`")


def sample(logits: np.ndarray, temperature: float, top_k: int, rng) -> int:
    with np.errstate(over="ignore"):
        z = logits.astype(np.float64) / temperature if temperature > 0 else None
    # a temperature so small that logits / T overflows is the greedy choice it tends to
    if z is None or not np.isfinite(z.max()):
        return int(np.argmax(logits))
    if 0 < top_k < len(z):
        z[z < np.sort(z)[-top_k]] = -np.inf
    p = np.exp(z - z.max())
    return int(rng.choice(len(z), p=p / p.sum()))


def check_options(tokens: int, temperature: float, top_k: int, seed: int) -> None:
    # NaN passes `< 0` and inf samples uniformly: neither is a temperature anyone means
    if not math.isfinite(temperature) or temperature < 0:
        raise FlowError(f"--temperature must be a finite number >= 0 (0: always the likeliest token), "
                        f"got {temperature}")
    for name, value in (("--tokens", tokens), ("--top-k", top_k), ("--seed", seed)):
        if value < 0:
            raise FlowError(f"{name} must be >= 0, got {value}")


def vocabulary(ckpt) -> tuple[object, str]:
    """(vocab, level) of a checkpoint of a model trained on text(...): the
    symbols it keeps, or at level "bpe" the tokenizer beside it."""
    data = ckpt.data or {}
    if data.get("level") == "bpe":
        from flowgrad.training import bpe

        return bpe.beside(ckpt), "bpe"
    if "vocab" not in data:
        raise FlowError(f"checkpoint {ckpt.path!r} keeps no vocabulary: generate needs a model trained on "
                        "text(...) data", hint='train with `data = text("file.txt", seq=seq)`')
    return data["vocab"], data.get("level", "char")


def generate(sess, vocab, level: str, prompt: str, tokens: int = 100, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0) -> str:
    """`prompt` followed by `tokens` sampled symbols, as text. `vocab`: the
    text's symbols, or at level "bpe" its tokenizer (vocabulary())."""
    return "".join(stream(sess, vocab, level, prompt, tokens, temperature, top_k, seed))


def stream(sess, vocab, level: str, prompt: str, tokens: int = 100, temperature: float = 1.0,
           top_k: int = 0, seed: int = 0):
    """The text generate returns, in pieces as it is sampled: the prompt, then
    each token's. The options, the prompt and the model's causality are checked
    here, before any piece is made."""
    check_options(tokens, temperature, top_k, seed)
    tok_in, logits_out, seq = lm_io(sess.graph)
    if not prompt:
        raise FlowError("the prompt is empty: generate continues a prompt of at least one character")
    ids = list(encode(prompt.encode() if level == "byte" else prompt, vocab, level))
    if not ids:
        raise FlowError(f"the prompt {prompt!r} encodes to no tokens of the model's tokenizer")
    check_causal(sess, tok_in, logits_out, seq, ids, len(vocab))
    sampled = sample_ids(sess, tok_in, logits_out, seq, ids, tokens, temperature, top_k, seed, len(vocab))
    return pieces(itertools.chain(list(ids), sampled), vocab, level)


def window_logits(sess, tok_in, logits_out, seq, ids, pad: int = 0) -> np.ndarray:
    """Next-token logits after the last `seq` ids, the row padded with `pad`."""
    window = ids[-seq:]
    row = np.full((1, seq), pad, np.int32)
    row[0, :len(window)] = window
    return sess.predict({tok_in: row})[logits_out][0, len(window) - 1]


def check_causal(sess, tok_in, logits_out, seq, ids, vocab_size) -> None:
    # only a window shorter than the row is padded, so only then can the padding leak in
    if len(ids) >= seq:
        return
    a = window_logits(sess, tok_in, logits_out, seq, ids)
    b = window_logits(sess, tok_in, logits_out, seq, ids, pad=vocab_size - 1)
    if not np.allclose(a, b, rtol=1e-4, atol=1e-4):
        raise FlowError(f"{sess.graph.name} is not causal: its logits at position {len(ids) - 1} "
                        "change with the tokens after it, so a window padded at the end gives wrong "
                        "predictions", hint="generate drives decoders with causal attention "
                                            "(attention(..., causal=true))")


def sample_ids(sess, tok_in, logits_out, seq, ids, tokens, temperature, top_k, seed, n_symbols=None):
    """Each new id as it is sampled (ids grows with them), among the first
    `n_symbols` ids (default: all the logits)."""
    rng = np.random.default_rng(seed)
    for _ in range(tokens):
        # a model may be sized past its text's vocabulary (vocab = 64 for 38 characters): the ids
        # beyond it stand for no symbol, so they are never sampled
        logits = window_logits(sess, tok_in, logits_out, seq, ids)[:n_symbols]
        ids.append(sample(logits, temperature, top_k, rng))
        yield ids[-1]
