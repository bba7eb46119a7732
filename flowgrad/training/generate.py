"""Sampling text from a language model trained on `text(...)`:
`flowgrad generate MODEL --checkpoint C --prompt "..." [--tokens N] [--temperature T] [--top-k K]`.

Each new token re-runs the whole window (the last `seq` tokens, no cache of
attention keys and values): slow for long windows, but it is the forward
pass that was trained. The window sits at positions 0..L-1 and the rest of
the row is padding, so the model must be causal (position i reads positions
up to i only), as a decoder with causal attention is; that is checked on the
first token, by padding with two different tokens and comparing."""
from __future__ import annotations


import numpy as np

from flowgrad.errors import FlowError
from flowgrad.training.data import output_inputs
from flowgrad.training.text import decode, encode


def lm_io(graph) -> tuple[str, str, int]:
    """(token input, logits output, window length) of a language model."""
    feats, _ = output_inputs(graph)
    tokens = [n for n in feats if graph.nodes[graph.inputs[n]].dtype == "i32"
              and len(graph.nodes[graph.inputs[n]].shape) == 2]
    if len(tokens) != 1:
        raise FlowError(f"{graph.name} is not a language model that generate can drive: it needs one input of "
                        "token ids shaped [batch, seq] that its outputs read")
    t = graph.nodes[graph.inputs[tokens[0]]].type
    for name, i in graph.outputs.items():
        o = graph.nodes[i].type
        if i != graph.loss and len(o.shape) == 3 and o.shape[:2] == t.shape:
            return tokens[0], name, t.shape[1]
    raise FlowError(f"{graph.name} has no output of next-token logits shaped [batch, seq, vocab]",
                    hint="declare it: `output logits`")


def sample(logits: np.ndarray, temperature: float, top_k: int, rng) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if 0 < top_k < len(z):
        z[z < np.sort(z)[-top_k]] = -np.inf
    p = np.exp(z - z.max())
    return int(rng.choice(len(z), p=p / p.sum()))


def generate(sess, vocab: list, level: str, prompt: str, tokens: int = 100, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0) -> str:
    """`prompt` followed by `tokens` sampled symbols, as text."""
    if temperature < 0:
        raise FlowError(f"--temperature must be >= 0 (0: always the likeliest token), got {temperature}")
    if tokens < 0 or top_k < 0:
        raise FlowError("--tokens and --top-k must be >= 0")
    tok_in, logits_out, seq = lm_io(sess.graph)
    if not prompt:
        raise FlowError("the prompt is empty: generate continues a prompt of at least one character")
    ids = list(encode(prompt if level == "char" else prompt.encode(), vocab, level))
    rng = np.random.default_rng(seed)
    for k in range(tokens):
        window = ids[-seq:]
        row = np.zeros((1, seq), np.int32)
        row[0, :len(window)] = window
        logits = sess.predict({tok_in: row})[logits_out][0, len(window) - 1]
        if k == 0 and len(window) < seq:
            other = row.copy()
            other[0, len(window):] = len(vocab) - 1
            again = sess.predict({tok_in: other})[logits_out][0, len(window) - 1]
            if not np.allclose(logits, again, rtol=1e-4, atol=1e-4):
                raise FlowError(f"{sess.graph.name} is not causal: its logits at position {len(window) - 1} "
                                "change with the tokens after it, so a window padded at the end gives wrong "
                                "predictions", hint="generate drives decoders with causal attention "
                                                    "(attention(..., causal=true))")
        ids.append(sample(logits, temperature, top_k, rng))
    return decode(ids, vocab, level)
