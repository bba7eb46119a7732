"""Inference: `flowgrad run FILE --checkpoint CKPT --feed name=file.npy ... [--out out.npz]`.

Inputs that only the loss depends on (the targets) may be left out: they are
fed zeros, and the outputs that depend on them (the loss) are not reported."""
from __future__ import annotations

import sys

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.training import checkpoint


def parse_feeds(items: list[str]) -> dict[str, np.ndarray]:
    feeds = {}
    for item in items or []:
        name, sep, file = item.partition("=")
        name = name.strip()
        if not sep or not name or not file:
            raise FlowError(f"--feed {item!r}: expected name=file.npy, e.g. --feed x=batch.npy")
        if name in feeds:
            raise FlowError(f"--feed {name} is given twice")
        try:
            feeds[name] = np.load(file, allow_pickle=False)
        except FileNotFoundError:
            raise FlowError(f"--feed {name}: no such file {file!r}") from None
        except (OSError, ValueError, EOFError) as e:
            raise FlowError(f"--feed {name}: cannot read {file!r} as a .npy array: {e}") from None
        if not isinstance(feeds[name], np.ndarray):
            raise FlowError(f"--feed {name}: {file!r} holds several arrays (an .npz); give one .npy per input")
    return feeds


def uses_inputs(graph, nid) -> set[str]:
    ids = {n.id for n in graph.needed_for([nid])}
    return {name for name, i in graph.inputs.items() if i in ids}


def complete_feeds(graph, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], set[str]]:
    """Add zeros for inputs that only the loss needs. Returns (feeds, the
    names of the inputs filled with zeros)."""
    wanted = [i for i in graph.outputs.values() if i != graph.loss] or list(graph.outputs.values())
    needed = set().union(*(uses_inputs(graph, i) for i in wanted)) if wanted else set()
    out, filled = dict(feeds), set()
    for name, nid in graph.inputs.items():
        if name in out:
            continue
        node = graph.nodes[nid]
        if name in needed:
            raise FlowError(f"missing --feed {name}=FILE.npy: the outputs of {graph.name} need input {name} "
                            f"({node.type})", node.span)
        out[name] = np.zeros(node.shape, NUMPY_DTYPE[node.dtype])
        filled.add(name)
    return out, filled


def run(sess, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outputs of one forward pass, leaving out those that depend on an
    input that was not fed."""
    graph = sess.graph
    full, filled = complete_feeds(graph, feeds)
    res = sess.step(full, grads=False)
    return {name: value for name, value in res.outputs.items()
            if not uses_inputs(graph, graph.outputs[name]) & filled}


def run_cli(args) -> int:
    import flowgrad as fg
    from flowgrad.cli import parse_sets

    model = fg.load(args.file, parse_sets(args.set))
    feeds = parse_feeds(args.feed)
    ckpt = checkpoint.load(args.checkpoint)
    # a model trained with --dtype f16 runs in f16: the checkpoint says which
    dtype = "f16" if any(a.dtype == np.float16 for a in ckpt.params.values()) else "f32"
    sess = model.compile(device=args.device, dtype=dtype)
    checkpoint.check_matches(ckpt, sess.graph)
    sess.set_params(ckpt.params)
    outputs = run(sess, feeds)
    if args.out:
        try:
            np.savez(args.out, **outputs)
        except OSError as e:
            raise FlowError(f"cannot write {args.out!r}: {e.strerror or e}") from None
        print(f"wrote {', '.join(outputs)} to {args.out}  (checkpoint step {ckpt.step})")
    else:
        with np.printoptions(threshold=64, edgeitems=3, precision=4, suppress=True):
            for name, value in outputs.items():
                print(f"{name}: {value.dtype}{list(value.shape)}\n{value}")
    sys.stdout.flush()
    return 0
