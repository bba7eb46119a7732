"""`flowgrad check|explain|run|train|bench|devices`."""
from __future__ import annotations

import argparse
import json
import sys

from flowgrad.errors import FlowError


def parse_sets(items: list[str]) -> dict:
    """`--set hidden=256 --set lr=1e-3` -> {"hidden": "256", ...}; values stay
    strings here and are typed against the model's config by the DSL."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FlowError(f"--set {item!r}: expected key=value, e.g. --set hidden=256")
        out[key.strip()] = value.strip()
    return out


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a .flow model file")
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
    report = sess.explain(analyze=args.analyze)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return 0


def cmd_train(args) -> int:
    from flowgrad.training.loop import train_cli

    return train_cli(args)


def cmd_run(args) -> int:
    from flowgrad.training.infer import run_cli

    return run_cli(args)


def cmd_devices(args) -> int:
    from flowgrad.exec_vulkan import list_devices_text

    print(list_devices_text())
    return 0


def cmd_bench(args) -> int:
    from flowgrad.exec_vulkan.bench import bench_cli

    return bench_cli(args)


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
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("train", help="train a model on the data named in its train section")
    add_model_args(p)
    add_session_args(p)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", default=None, help="directory for checkpoints, metrics.jsonl and loss.png")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--overwrite", action="store_true", help="start afresh even if --out holds a checkpoint")
    p.add_argument("--check-finite", action="store_true",
                   help="stop at the first non-finite loss or gradient, naming the node that produced it")
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

    p = sub.add_parser("bench", help="graph vs closures step time on one device (the DESIGN's decoder example)")
    p.add_argument("file", nargs="?", default=None, help="a .flow model (default: tiny_gpt at d=64, seq=64)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--device", default="vulkan")
    p.add_argument("--dtype", default="f32", choices=["f32", "f16"])
    p.add_argument("--repeats", type=int, default=20)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
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
