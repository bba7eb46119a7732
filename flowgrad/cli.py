"""flowgrad: train, run and export models written in the .flow language.

Commands: check, explain, train, run, generate, export, bench, devices;
`flowgrad COMMAND --help` shows each one's options and an example."""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from flowgrad.errors import FlowError, FlowWarning


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


def load_model(file, sets: dict | None = None):
    """fg.load with --set overrides; a key that is not in the config but is
    a train setting or an optimizer argument gets an error saying so."""
    import flowgrad as fg

    try:
        return fg.load(file, sets)
    except FlowError as e:
        if not sets:
            raise
        base = fg.load(file)
        better = next((m for m in (not_a_config_key(base.graph, k, v) for k, v in sets.items()
                                   if k not in base.config) if m is not None), None)
        if better is None:
            raise
        raise better from e


def not_a_config_key(graph, key: str, value: str) -> FlowError | None:
    """The error for `--set KEY=VALUE` where KEY names a train setting or an
    optimizer argument rather than a config key, at the train line using it."""
    from flowgrad.training import spec
    from flowgrad.training.loop import TRAIN_KEYS
    from flowgrad.training.optim import OPTIMIZERS, Optimizer

    items = graph.train.items if graph.train is not None else {}
    spans = graph.train.spans if graph.train is not None else {}
    if key == "steps":
        return FlowError(f"--set steps={value}: steps is a train setting, not a config key", spans.get("steps"),
                         hint=f"pass --steps {value}")
    opt_args = {a for cls in OPTIMIZERS.values() for a in cls.ARGS} | set(Optimizer.COMMON)
    if key in opt_args:
        opt = spec.call_parts(items.get("optimizer", ("call", "adam", (), {})))
        given = opt[2].get(key) if opt else None
        shown = f" (the train section gives {key}={spec.show(given)})" if given is not None else ""
        return FlowError(f"--set {key}={value}: {key} is an optimizer argument{shown}, not a config key of "
                         f"{graph.name}", spans.get("optimizer") or spans.get(key),
                         hint=f"declare `{key} = ...` in config and write `{key}={key}` in the optimizer call "
                              f"(e.g. adam({key}={key})); then --set {key}=... reaches it")
    if key in TRAIN_KEYS:
        return FlowError(f"--set {key}={value}: {key} is a train setting, not a config key of {graph.name}",
                         spans.get(key), hint=f"declare `{key} = ...` in config and write `{key} = {key}` in the "
                                              "train section; then --set reaches it")
    return None


def train_summary(graph) -> str:
    from flowgrad.training.loop import setup

    ts = setup(graph)
    data = ts.data
    sizes = getattr(data, "size", None)
    rows = (f" ({', '.join(f'{sizes(s)} {s}' for s in ('train', 'val', 'test'))} rows)" if sizes else "")
    metric = f"metric {ts.metric.name}" + (f" on {ts.metric.output}" if ts.metric.output else "")
    return f"{data.describe}{rows}, {metric}, {ts.steps} steps"


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a .flow model file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (repeatable), e.g. --set hidden=256")


def add_session_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (a GPU's Vulkan device, else numpy), cpu, vulkan (any "
                   "Vulkan device, lavapipe too) or vulkan:N (default auto)")
    p.add_argument("--dtype", default="f32", choices=["f32", "f16"], help="the compile dtype of floats "
                   "(default f32)")
    p.add_argument("--backward", default="auto", choices=["auto", "graph", "closures"],
                   help="execution path of the backward pass: auto lets the planner choose; graph makes a "
                        "refusal an error (default auto)")


def cmd_check(args) -> int:
    """The model's summary, then every error of its train section."""
    from flowgrad.training.loop import check_train

    model = load_model(args.file, parse_sets(args.set))
    print(summary(model.graph))
    if model.graph.train is None:
        print("train   (no train section)")
        return 0
    errors = check_train(model.graph)
    if not errors:
        print(f"train   ok: {train_summary(model.graph)}")
        return 0
    print(f"train   {len(errors)} error{'s' if len(errors) > 1 else ''}:", file=sys.stderr)
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1


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
    model = load_model(args.file, parse_sets(args.set))
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


def cmd_generate(args) -> int:
    from flowgrad.training.generate import generate_cli

    return generate_cli(args)


def cmd_export(args) -> int:
    from flowgrad.export_onnx import export_cli

    return export_cli(args)


def cmd_devices(args) -> int:
    from flowgrad.exec_vulkan import list_devices_text

    print(list_devices_text())
    return 0


def cmd_bench(args) -> int:
    from flowgrad.exec_vulkan.bench import bench_cli

    return bench_cli(args)


EXAMPLES = {
    "check": "flowgrad check models/mlp.flow --set hidden=256",
    "explain": "flowgrad explain models/tiny_gpt.flow --device vulkan --analyze",
    "train": "flowgrad train models/mlp.flow --out runs/mlp --steps 400\n"
             "  flowgrad train models/mlp.flow --out runs/mlp --resume --steps 800",
    "run": "flowgrad run models/mlp.flow --checkpoint runs/mlp/checkpoint.safetensors --feed x=rows.csv "
           "--out pred.csv",
    "generate": "flowgrad generate models/char_lm.flow --checkpoint runs/char_lm/checkpoint.safetensors "
                "--prompt \"It was\" --tokens 100 --temperature 0.8 --top-k 10",
    "export": "flowgrad export models/mlp.flow --checkpoint runs/mlp/checkpoint.safetensors -o mlp.onnx",
    "bench": "flowgrad bench --device vulkan --repeats 20",
    "devices": "flowgrad devices",
}


def _sub(sub, name: str, help: str):
    return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                          epilog=f"example:\n  {EXAMPLES[name]}", formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    from flowgrad import __version__

    parser = argparse.ArgumentParser(prog="flowgrad", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example:\n  flowgrad train models/mlp.flow --out runs/mlp")
    parser.add_argument("--version", action="version", version=f"flowgrad {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _sub(sub, "check", "parse and type-check a model and its train section, print a summary")
    add_model_args(p)
    p.set_defaults(func=cmd_check)

    p = _sub(sub, "explain", "show the execution plan and why")
    add_model_args(p)
    add_session_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (docs/explain.md)")
    p.add_argument("--analyze", action="store_true", help="run a few steps and add measured times")
    p.set_defaults(func=cmd_explain)

    p = _sub(sub, "train", "train a model on the data named in its train section")
    add_model_args(p)
    add_session_args(p)
    p.add_argument("--steps", type=int, default=None, help="how many steps in all (default: the train "
                   "section's steps); with --resume, a number above the checkpoint's step trains further")
    p.add_argument("--out", default=None, metavar="DIR", help="directory for checkpoint.safetensors, "
                   "best.safetensors, metrics.jsonl and loss.png (default runs/MODEL)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--overwrite", action="store_true", help="start afresh even if --out holds a checkpoint")
    p.set_defaults(func=cmd_train)
    p = _sub(sub, "run", "inference from a checkpoint, at any batch size")
    add_model_args(p)
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by `flowgrad train`; its config is "
                   "used, --set overrides it")
    p.add_argument("--feed", action="append", default=[], metavar="NAME=FILE",
                   help="an input from a .npy, .csv or single-array .npz file (rows first; any number of rows), "
                        "or FILE.npz whose arrays are named as the inputs; repeat per input")
    p.add_argument("--output", action="append", default=[], metavar="NAME", help="report only this output "
                   "(repeatable; default: every output the feeds determine)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the outputs to FILE: .npz (all), .npy (one) "
                   "or .csv (one column per value, one row per batch row); default: print them")
    p.add_argument("--device", default="auto", help="auto, cpu, vulkan or vulkan:N")
    p.set_defaults(func=cmd_run)

    p = _sub(sub, "generate", "sample text from a language model trained on text(...) data")
    add_model_args(p)
    p.add_argument("--checkpoint", required=True, help="a checkpoint of a text-trained model (it holds the vocab)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--tokens", type=int, default=200, help="how many tokens to add (default 200)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 always takes the "
                   "likeliest token (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K likeliest tokens only (default 0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", default="auto", help="auto, cpu, vulkan or vulkan:N")
    p.set_defaults(func=cmd_generate)

    p = _sub(sub, "export", "write a trained model's forward graph as an ONNX file")
    add_model_args(p)
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by `flowgrad train`; its config is "
                   "used, --set overrides it (e.g. --set batch=1 for the exported batch size)")
    p.add_argument("-o", "--output-file", required=True, metavar="FILE.onnx", help="where to write the ONNX model")
    p.add_argument("--output", action="append", default=[], metavar="NAME", help="export this output (repeatable; "
                   "default: every output that does not read the targets)")
    p.add_argument("--device", default="cpu", help="where to load the params (default cpu)")
    p.set_defaults(func=cmd_export)

    p = _sub(sub, "devices", "list Vulkan devices")
    p.set_defaults(func=cmd_devices)

    p = _sub(sub, "bench", "graph vs closures step time on one device (the decoder example: tiny_gpt at d=64, "
                           "seq=64)")
    p.add_argument("file", nargs="?", default=None, help="a .flow model (default: tiny_gpt at d=64, seq=64)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--device", default="vulkan", help="vulkan or vulkan:N (default vulkan)")
    p.add_argument("--dtype", default="f32", choices=["f32", "f16"], help="compile dtype (default f32)")
    p.add_argument("--repeats", type=int, default=20, help="timed graph-path steps; closures get a quarter "
                   "(default 20)")
    p.set_defaults(func=cmd_bench)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """FlowWarnings as one `warning:` line; others as Python shows them."""
    if issubclass(category, FlowWarning):
        print(f"warning: {message}", file=sys.stderr)
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


_python_showwarning = warnings.showwarning


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    warnings.showwarning = _show_warning
    try:
        rc = args.func(args)
        sys.stdout.flush()  # here, not at exit, so a closed pipe is caught below
        return rc
    except FlowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader (`| head`) went away: stop quietly; point stdout at
        # /dev/null so the interpreter's final flush does not raise again
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    finally:
        warnings.showwarning = _python_showwarning


if __name__ == "__main__":
    sys.exit(main())
