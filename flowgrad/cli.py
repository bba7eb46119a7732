"""`flowgrad check|explain|run|train|bench|devices`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from flowgrad.dsl.config import parse_sets
from flowgrad.errors import FlowError


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a .flow model file, or the name of a shipped model (mlp, tiny_gpt, ...)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")


def add_session_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto, cpu, vulkan or vulkan:N")
    p.add_argument("--dtype", default="f32", choices=["f32", "f16"])
    p.add_argument("--backward", default="auto", choices=["auto", "graph", "closures"])


def cmd_check(args) -> int:
    import flowgrad as fg

    model = fg.load(args.file, parse_sets(args.set))
    print(summary(model.graph))
    return 0


def summary(graph) -> str:
    """One screen: inputs, params (a block's instances on one line), outputs."""
    lines = [f"model {graph.name}   ({graph.file}, {len(graph.nodes)} nodes)"]
    if graph.config:
        lines.append("config  " + "  ".join(f"{k}={v}" for k, v in graph.config.items()))
    lines.append("inputs")
    lines += [f"  {name:<24} {graph.nodes[i].type}" for name, i in graph.inputs.items()]
    lines.append(f"params ({graph.param_count():,} values)")
    for name, nodes in grouped_params(graph):
        node = nodes[0]
        count = f"  x{len(nodes)}" if len(nodes) > 1 else ""
        lines.append(f"  {name:<24} {str(node.type):<20} {node.type.size:>10,}  {node.attrs['init'][0]}(){count}")
    lines.append("outputs")
    lines += [f"  {name:<24} {graph.nodes[i].type}" for name, i in graph.outputs.items()]
    if graph.loss is not None:
        lines.append(f"minimize {graph.nodes[graph.loss].label}")
    return "\n".join(lines)


def grouped_params(graph):
    """decoder.0.wqkv, decoder.1.wqkv, ... -> ("decoder.0-1.wqkv", [nodes])."""
    import re

    groups: dict[tuple, list] = {}
    for name, i in graph.params.items():
        node = graph.nodes[i]
        key = (re.sub(r"\.\d+\.", ".#.", name), node.type, node.attrs["init"][0])
        groups.setdefault(key, []).append((name, node))
    out = []
    for (pattern, _, _), members in groups.items():
        if len(members) == 1:
            out.append((members[0][0], [members[0][1]]))
            continue
        first, last = (re.search(r"\.(\d+)\.", n).group(1) for n in (members[0][0], members[-1][0]))
        out.append((pattern.replace(".#.", f".{first}-{last}.", 1), [node for _, node in members]))
    return out


def cmd_explain(args) -> int:
    import flowgrad as fg

    model = fg.load(args.file, parse_sets(args.set))
    sess = model.compile(device=args.device, dtype=args.dtype, backward=args.backward)
    if args.ranks is not None:
        if args.ranks < 1:
            raise FlowError(f"--ranks must be at least 1, got {args.ranks}")
        sess.ranks = args.ranks
    report = sess.explain(analyze=args.analyze)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return 0


# -- train -----------------------------------------------------------------------------

def cmd_train(args) -> int:
    import flowgrad as fg
    from flowgrad.training import distributed
    from flowgrad.training.loop import TrainInterrupted

    if args.ranks is not None:
        if distributed.launched():
            raise FlowError("--ranks starts mpiexec itself: under mpiexec/mpirun leave it out")
        return distributed.launch(args.ranks, distributed.strip_ranks(args.argv))
    model = fg.load(args.file, parse_sets(args.set))
    out = args.out if args.out is not None else str(Path("runs") / model.name)
    try:
        result = fg.train(model, steps=args.steps, device=args.device, dtype=args.dtype, backward=args.backward,
                          out=out, resume=args.resume, overwrite=args.overwrite, check_every=args.check_every)
    except TrainInterrupted as e:
        if getattr(e, "rank", 0) == 0:
            print(f"\n{e}", file=sys.stderr)
        return 130
    if result.rank == 0:
        print(train_summary(result))
    return 0


def train_summary(result) -> str:
    from flowgrad.training import checkpoint

    lines = [f"{result.steps} steps; this run: {result.steps_run} steps in {result.seconds:.1f} s "
             f"({result.steps_per_second:.1f} steps/s)"]
    if result.ranks > 1:
        lines.append(f"data-parallel on {result.ranks} ranks (global batch = batch x {result.ranks})")
    rows = [("final train loss", f"{result.loss:.4f}")] if result.loss is not None else []
    rows += [(f"test {k}", f"{v:.2%}") for k, v in result.metrics.items()]
    rows.append(("path", result.path))
    if result.out is not None:
        written = [p.name for p in (result.out / "metrics.jsonl", result.out / "loss.png") if p.exists()]
        rows.append(("wrote", ", ".join([str(result.out / checkpoint.FILENAME)] + written)))
    width = max(len(k) for k, _ in rows) + 2
    lines += [f"{k:<{width}}{v}" for k, v in rows]
    return "\n".join(lines)


# -- run ---------------------------------------------------------------------------------

def cmd_run(args) -> int:
    import flowgrad as fg
    from flowgrad.training import checkpoint, infer

    model = fg.load(args.file, parse_sets(args.set))
    feeds = parse_feeds(args.feed)
    ckpt = checkpoint.load(args.checkpoint)
    # a model trained with --dtype f16 runs in f16: the checkpoint says which
    dtype = "f16" if any(a.dtype == np.float16 for a in ckpt.params.values()) else "f32"
    sess = model.compile(device=args.device, dtype=dtype)
    checkpoint.check_matches(ckpt, sess.graph)
    sess.set_params(ckpt.params)
    outputs = infer.run(sess, feeds)
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


def parse_feeds(items: list[str]) -> dict[str, np.ndarray]:
    """`--feed x=batch.npy ...` -> {"x": array}."""
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


# -- devices, bench ----------------------------------------------------------------------

def cmd_devices(args) -> int:
    print(devices_text())
    return 0


def devices_text() -> str:
    from flowgrad.errors import DeviceError
    from flowgrad.exec_vulkan import runtime

    try:
        runtime.instance()     # a loader or validation-layer problem is worth showing as such
    except DeviceError as e:
        return f"no Vulkan devices: {e}"
    devices = runtime.list_devices()
    if not devices:
        return ("no Vulkan devices (install a Vulkan driver; Debian: mesa-vulkan-drivers gives lavapipe, "
                "a CPU device usable with --device vulkan)")
    auto = runtime.first_gpu(devices)
    lines = []
    for d in devices:
        caps = ", ".join(x for x, ok in (("f16", d.f16), ("cooperative matrix", d.coopmat),
                                          ("timestamps", d.timestamps)) if ok) or "f32 only"
        mark = "  <- auto" if d.index == auto else ""
        lines.append(f"vulkan:{d.index}  {d.name}  [{d.type}]  {d.memory / 2**30:.1f} GiB  "
                     f"Vulkan {d.api_version}  ({caps}){mark}")
    if auto is None:
        lines.append("device='auto' runs on numpy (no GPU); --device vulkan uses vulkan:0")
    return "\n".join(lines)


def cmd_bench(args) -> int:
    from flowgrad.exec_vulkan import bench

    if args.ranks is not None:
        from flowgrad.training import bench_ranks

        rows = bench_ranks.run(args.file or bench.MODEL, args.ranks, args.device, args.repeats,
                               {**(bench.DECODER if args.file is None else {}), **parse_sets(args.set)}, args.dtype)
        print(bench_ranks.report(rows))
        return 0

    r = bench.run(args.file or bench.MODEL, device=args.device, repeats=args.repeats, config=parse_sets(args.set),
                  dtype=args.dtype)
    print(bench.report(r))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowgrad", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="parse and type-check a model, print a summary")
    add_model_args(p)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("explain", help="show the execution plan and why")
    add_model_args(p)
    add_session_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (docs/explain.md)")
    p.add_argument("--analyze", action="store_true", help="run a few steps and add measured times")
    p.add_argument("--ranks", type=int, default=None, metavar="N", help="describe data-parallel training on N ranks")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("train", help="train a model on the data named in its train section")
    add_model_args(p)
    add_session_args(p)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", default=None, help="directory for checkpoints, metrics.jsonl and loss.png")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--overwrite", action="store_true", help="start afresh even if --out holds a checkpoint")
    p.add_argument("--ranks", type=int, default=None, metavar="N",
                   help="data-parallel on N ranks of this host (starts mpiexec; needs flowgrad[mpi])")
    p.add_argument("--check-every", type=int, default=None, metavar="STEPS",
                   help="data-parallel: steps between checks that all ranks hold the same params")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("run", help="inference from a checkpoint")
    add_model_args(p)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--feed", action="append", default=[], metavar="NAME=FILE.npy")
    p.add_argument("--out", default=None, help="write outputs to this .npz")
    p.add_argument("--device", default="auto")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("devices", help="list Vulkan devices")
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("bench", help="graph vs closures step time on one device (a small decoder)")
    p.add_argument("file", nargs="?", default=None,
                   help="a .flow model or a shipped model's name (default: tiny_gpt at d=64, seq=64)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--device", default="vulkan")
    p.add_argument("--dtype", default="f32", choices=["f32", "f16"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--ranks", type=int, default=None, metavar="N",
                   help="data-parallel training steps at 1..N ranks (mpiexec): step time, samples/s, all-reduce share")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except FlowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
