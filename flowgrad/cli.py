"""The `flowgrad` command: check, explain, train, run, generate, export,
bench, devices.

Every command's argv-to-library adapter lives in this one file (it runs past
400 lines for that reason), so that no library module imports the CLI."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from flowgrad.dsl.config import parse_sets
from flowgrad.dtypes import MIXED_HALVES
from flowgrad.errors import FlowError, FlowWarning
from flowgrad.initializers import init_text
from flowgrad.overrides import load_model


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a .flow model file, or the name of a shipped model (mlp, tiny_gpt, ...)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (repeatable), e.g. --set hidden=256")


def add_session_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (a GPU's Vulkan device, else numpy), cpu, vulkan (any "
                   "Vulkan device, lavapipe too) or vulkan:N (default auto)")
    p.add_argument("--dtype", default="f32", choices=["f32", "f16", "mixed"], help="the compile dtype of floats: "
                   "f32, f16, or mixed (16-bit compute, f32 master params; default f32)")
    p.add_argument("--mixed", default="auto", choices=list(MIXED_HALVES),
                   help="what --dtype mixed computes in: bf16 (no loss scaling), f16 (with loss scaling), or auto: "
                        "bf16 where the device multiplies bf16 on cooperative matrices, else f16 (default auto)")
    p.add_argument("--backward", default="auto", choices=["auto", "graph", "closures"],
                   help="execution path of the backward pass: auto lets the planner choose; graph makes a "
                        "refusal an error (default auto)")


def add_budget_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="bytes (or a size: 512MB, 20GB, 16GiB) the training step's planned peak must fit: the "
                        "backward computes the cheapest forward values again instead of keeping them")


def cmd_check(args) -> int:
    """The model's summary, then every error of its train section."""
    from flowgrad.training.section import check_train

    model = load_model(args.file, parse_sets(args.set))
    print(summary(model.graph))
    if model.graph.train is None:
        print("train   (no train section)")
        return 0
    errors = check_train(model.graph)
    if not errors:
        print(f"train   ok: {section_summary(model.graph)}")
        return 0
    print(f"train   {len(errors)} error{'s' if len(errors) > 1 else ''}:", file=sys.stderr)
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1


def summary(graph) -> str:
    """One screen: inputs, params and state (a block's instances on one line), outputs."""
    lines = [f"model {graph.name}   ({graph.file}, {len(graph.nodes)} nodes)"]
    if graph.config:
        lines.append("config  " + "  ".join(f"{k}={v}" for k, v in graph.config.items()))
    lines.append("inputs")
    lines += [f"  {name:<24} {graph.nodes[i].type}" for name, i in graph.inputs.items()]
    for state, title in ((False, "params"), (True, "state")):
        groups = grouped_params(graph, state)
        if groups or not state:
            total = sum(node.type.size for _, nodes in groups for node in nodes)
            lines.append(f"{title} ({total:,} values)")
        for name, nodes in groups:
            node = nodes[0]
            count = f"  x{len(nodes)}" if len(nodes) > 1 else ""
            lines.append(f"  {name:<24} {str(node.type):<20} {node.type.size:>10,}  {init_text(node)}{count}")
    lines.append("outputs")
    lines += [f"  {name:<24} {graph.nodes[i].type}" for name, i in graph.outputs.items()]
    for obj in graph.objectives:
        lines.append(f"minimize {obj.name}" + (f" over {', '.join(obj.over)}" if obj.over is not None else ""))
    if graph.loss is not None and not graph.objectives:
        lines.append(f"minimize {graph.nodes[graph.loss].label}")
    return "\n".join(lines)


def grouped_params(graph, state: bool):
    """decoder.0.wqkv, decoder.1.wqkv, ... -> ("decoder.0-1.wqkv", [nodes]);
    the trainable params, or with state the state tensors (batch norm's running statistics)."""
    import re

    groups: dict[tuple, list] = {}
    for name, i in graph.params.items():
        node = graph.nodes[i]
        if bool(node.attrs.get("state")) != state:
            continue
        key = (re.sub(r"\.\d+\.", ".#.", name), node.type, init_text(node))
        groups.setdefault(key, []).append((name, node))
    out = []
    for (pattern, _, _), members in groups.items():
        if len(members) == 1:
            out.append((members[0][0], [members[0][1]]))
            continue
        first, last = (re.search(r"\.(\d+)\.", n).group(1) for n in (members[0][0], members[-1][0]))
        out.append((pattern.replace(".#.", f".{first}-{last}.", 1), [node for _, node in members]))
    return out


def section_summary(graph) -> str:
    from flowgrad.training.section import setup

    ts = setup(graph)
    data = ts.data
    sizes = getattr(data, "size", None)
    rows = (f" ({', '.join(f'{sizes(s)} {s}' for s in ('train', 'val', 'test'))} rows)" if sizes else "")
    metric = f"metric {ts.metric.name}" + (f" on {ts.metric.output}" if ts.metric.output else "")
    # inputs fed beyond the features and targets: an npz feeds them by name, unseen otherwise
    also = [n for n in data.inputs.values() if n not in (data.feature, data.target)]
    feeds = f", also feeds {', '.join(also)}" if also else ""
    return f"{data.describe}{rows}{feeds}, {metric}, {ts.steps} steps"


def cmd_explain(args) -> int:
    model = load_model(args.file, parse_sets(args.set))
    from flowgrad.training.section import freeze_patterns, memory_budget

    # the step training runs: with the train section's frozen params and memory budget
    sess = model.compile(device=args.device, dtype=args.dtype, backward=args.backward, mixed=args.mixed,
                         freeze=freeze_patterns(model.graph),
                         memory_budget=memory_budget(model.graph, args.memory_budget))
    if args.ranks is not None:
        at_least_one("--ranks", args.ranks)
        from flowgrad.training.distributed import describe_ranks

        describe_ranks(sess, args.ranks)
    report = sess.explain(analyze=args.analyze)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return 0


# -- train -----------------------------------------------------------------------------

def cmd_train(args) -> int:
    import flowgrad as fg
    from flowgrad.training import distributed
    from flowgrad.trainer import TrainInterrupted

    if args.ranks is not None:
        if distributed.launched():
            raise FlowError("--ranks starts mpiexec itself: under mpiexec/mpirun leave it out")
        from flowgrad.training import mpi_launch

        return mpi_launch.launch(args.ranks, mpi_launch.strip_ranks(args.argv))
    if args.steps is not None:
        at_least_one("--steps", args.steps)
    model = load_model(args.file, parse_sets(args.set))
    out = args.out if args.out is not None else str(Path("runs") / model.name)
    try:
        result = fg.train(model, steps=args.steps, device=args.device, dtype=args.dtype, backward=args.backward,
                          mixed=args.mixed,
                          out=out, resume=args.resume, overwrite=args.overwrite, check_every=args.check_every,
                          check_finite=args.check_finite, seed=args.seed, memory_budget=args.memory_budget)
    except TrainInterrupted as e:
        if getattr(e, "rank", 0) == 0:
            print(f"\n{e}", file=sys.stderr)
        return 128 + e.signum   # the shell's status for a death by that signal: 130 Ctrl-C, 143 SIGTERM
    if result.rank == 0:
        print(train_summary(result))
    return 0


def train_summary(result) -> str:
    from flowgrad.training import checkpoint
    from flowgrad.trainer import BEST_FILENAME
    from flowgrad.training.metrics import fmt

    lines = [f"{result.steps} steps; this run: {result.steps_run} steps in {result.seconds:.1f} s "
             f"({result.steps_per_second:.1f} steps/s)"]
    if result.ranks > 1:
        lines.append(f"data-parallel on {result.ranks} ranks (global batch = batch x {result.ranks})")
    if result.stopped_early:
        lines.append(f"stopped early: the validation loss did not improve after step {result.best['step']}")
    # several objectives: each one's loss, by its name
    last = (result.history[-1].get("losses") if result.history else None) or {"loss": result.loss}
    rows = [(f"final train {k}", f"{v:.4f}") for k, v in last.items() if v is not None]
    tested = result.metrics.get("losses") or {}
    rows += [(f"test {k}", fmt("loss", v)) for k, v in tested.items()]
    rows += [(f"test {k}", fmt(k, v)) for k, v in result.metrics.items()
             if k != "losses" and not (tested and k == "loss")]   # with several, the first's is listed
    if result.best is not None:
        rows.append(("best val loss", f"{result.best['val_loss']:.4f} at step {result.best['step']}"))
    rows.append(("path", result.path))
    if result.out is not None:
        written = [p.name for p in (result.out / BEST_FILENAME, result.out / "metrics.jsonl",
                                    result.out / "loss.png") if p.exists()] + result.files
        rows.append(("wrote", ", ".join([str(result.out / checkpoint.FILENAME)] + written)))
    width = max(len(k) for k, _ in rows) + 2
    lines += [f"{k:<{width}}{v}" for k, v in rows]
    return "\n".join(lines)


# -- run ---------------------------------------------------------------------------------

def cmd_run(args) -> int:
    from flowgrad.training.arrayfiles import out_format, parse_feeds, write_outputs
    from flowgrad.training.infer import output_names
    from flowgrad.overrides import load_trained
    from flowgrad.training.tabular import RunPrep

    if args.out:
        out_format(args.out)  # a bad --out fails before the model loads and runs, not after
    sess, ckpt = load_trained(args.file, args.checkpoint, parse_sets(args.set), args.device, args.seed)
    output_names(sess.graph, args.output or None, "--output")   # a bad --output fails before the feeds are read
    # only the inputs the asked-for outputs read need feeding (not the labels a metric output reads)
    # rows prepared as the train section's data source prepared its own (na=, categorical=, standardize=)
    outputs = sess.predict(parse_feeds(args.feed, sess.graph, RunPrep(ckpt.data)), args.output or None)
    if args.output:
        outputs = {o: outputs[o] for o in args.output}   # in the order asked for
    if args.out:
        write_outputs(args.out, outputs)
        print(f"wrote {', '.join(f'{k} {v.dtype}{list(v.shape)}' for k, v in outputs.items())} to {args.out}  "
              f"(checkpoint step {ckpt.step})")
    else:
        with np.printoptions(threshold=64, edgeitems=3, precision=4, suppress=True):
            for name, value in outputs.items():
                print(f"{name}: {value.dtype}{list(value.shape)}\n{value}")
    return 0


# -- generate, export ---------------------------------------------------------------------

TEXT_OPTIONS = {"prompt": None, "tokens": 200, "temperature": 1.0, "top_k": 0}   # and their defaults
IMAGE_OPTIONS = {"out": None, "samples": 64, "output": None}


def cmd_generate(args) -> int:
    """Text from a language model (a checkpoint that keeps a vocabulary), else
    images a generative model draws from noise, written as a PNG grid."""
    from flowgrad.overrides import load_trained

    if args.seed < 0:   # before the session takes it as its seed
        raise FlowError(f"--seed must be >= 0, got {args.seed}")
    if args.samples is not None:
        at_least_one("--samples", args.samples)
    if args.out is not None and Path(args.out).suffix.lower() != ".png":
        raise FlowError(f"--out {args.out}: generate writes its images as a PNG grid: name a .png file")
    sess, ckpt = load_trained(args.file, args.checkpoint, parse_sets(args.set), args.device, args.seed)
    text = "vocab" in (ckpt.data or {}) or (ckpt.data or {}).get("level") == "bpe"
    given = [f"--{k.replace('_', '-')}" for k in (IMAGE_OPTIONS if text else TEXT_OPTIONS)
             if getattr(args, k) is not None]
    if given:
        kind = "text: it takes --prompt" if text else "images from noise: it takes --out FILE.png"
        raise FlowError(f"{', '.join(given)}: {sess.graph.name} generates {kind}")
    if text:
        return generate_text(args, sess, ckpt)
    from flowgrad.training.image_samples import sample_images, write_grid

    if args.out is None:
        raise FlowError(f"{sess.graph.name} keeps no vocabulary, so generate draws images from it: pass "
                        "--out FILE.png for the grid", hint="a language model trained on text(...) generates text")
    images = sample_images(sess, args.samples or IMAGE_OPTIONS["samples"], args.output, args.seed)
    write_grid(images, args.out)
    print(f"wrote {len(images)} samples of {sess.graph.name} to {args.out}  (checkpoint step {ckpt.step})")
    return 0


def generate_text(args, sess, ckpt) -> int:
    from flowgrad.training.generate import stream, vocabulary

    if args.prompt is None:
        raise FlowError(f"{sess.graph.name} generates text: pass --prompt TEXT, the text to continue")
    options = {k: TEXT_OPTIONS[k] if getattr(args, k) is None else getattr(args, k) for k in TEXT_OPTIONS}
    vocab, level = vocabulary(ckpt)
    pieces = stream(sess, vocab, level, options["prompt"], options["tokens"], options["temperature"],
                    options["top_k"], args.seed)
    # printed as sampled, so a long --tokens shows its progress and Ctrl-C keeps what came
    try:
        for piece in pieces:
            print(piece, end="", flush=True)
    finally:
        print()
    return 0


def cmd_export(args) -> int:
    from flowgrad.export_onnx import OPSET, export, signature
    from flowgrad.overrides import load_trained

    sess, ckpt = load_trained(args.file, args.checkpoint, parse_sets(args.set), args.device)
    export(sess, args.output_file, args.output or None, dynamic_batch=not args.fixed_batch)
    print(f"wrote {args.output_file}: ONNX opset {OPSET}, {signature(args.output_file)}  (checkpoint step {ckpt.step})")
    return 0


# -- devices, bench ----------------------------------------------------------------------

def cmd_devices(args) -> int:
    print(devices_text())
    return 0


def devices_text() -> str:
    from flowgrad.errors import DeviceError
    from flowgrad.exec_vulkan import runtime
    from flowgrad.mixed_choice import choose

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
                                          ("bf16 cooperative matrix", not d.bf16_lacks),
                                          ("timestamps", d.timestamps)) if ok) or "f32 only"
        mark = "  <- auto" if d.index == auto else ""
        lines.append(f"vulkan:{d.index}  {d.name}  [{d.type}]  {d.memory / 2**30:.1f} GiB  "
                     f"Vulkan {d.api_version}  ({caps}){mark}")
        lines.append(f"  --dtype mixed computes in {choose('auto', d).summary}")
    if auto is None:
        lines.append("device='auto' runs on numpy (no GPU); --device vulkan uses vulkan:0")
    return "\n".join(lines)


def cmd_bench(args) -> int:
    at_least_one("--repeats", args.repeats)
    if args.file == "gpt2":
        return cmd_bench_gpt2(args)
    given = [flag for flag, value in (("--steps", args.steps), ("--warmup", args.warmup), ("--batch", args.batch),
                                      ("--families", args.families or None)) if value is not None]
    if given:
        raise FlowError(f"{', '.join(given)}: options of `bench gpt2`; bench MODEL takes --repeats and --set batch=N")
    args.dtype = args.dtype or "f32"
    if args.file == "matmul":
        return cmd_bench_matmul(args)
    if args.dtype == "bf16":
        raise FlowError("--dtype bf16 is bench matmul's: a model's step computes in bf16 under --dtype mixed")
    from flowgrad.bench import step as bench

    if args.ranks is not None:
        at_least_one("--ranks", args.ranks)
        from flowgrad.bench import ranks

        rows = ranks.run(args.file or bench.MODEL, args.ranks, args.device, args.repeats,
                         {**(bench.DECODER if args.file is None else {}), **parse_sets(args.set)}, args.dtype)
        print(ranks.report(rows))
        return 0
    check_bench_device(args.device)
    t0 = time.perf_counter()

    def phase(text):
        print(f"bench [{time.perf_counter() - t0:5.1f} s] {text}", file=sys.stderr, flush=True)

    r = bench.run(args.file or bench.MODEL, device=args.device, repeats=args.repeats, config=parse_sets(args.set),
                  dtype=args.dtype, phase=phase, compare=args.compare, memory_budget=args.memory_budget)
    print(json.dumps(r, indent=2) if args.json else bench.report(r))
    return 0


def cmd_bench_gpt2(args) -> int:
    from flowgrad.bench import gpt2

    steps = 20 if args.steps is None else args.steps
    warmup = 5 if args.warmup is None else args.warmup
    at_least_one("--steps", steps)
    if warmup < 0:
        raise FlowError(f"--warmup must be at least 0, got {warmup}")
    if args.dtype in ("f16", "bf16"):
        raise FlowError("bench gpt2 times f32 and mixed precision: --dtype f32 or mixed (default: both)")
    config = parse_sets(args.set)
    if args.batch is not None:
        at_least_one("--batch", args.batch)
        config["batch"] = str(args.batch)
    check_bench_device(args.device)
    t0 = time.perf_counter()

    def phase(text):
        print(f"bench [{time.perf_counter() - t0:5.1f} s] {text}", file=sys.stderr, flush=True)

    r = gpt2.run(args.device, config, steps, warmup, (args.dtype,) if args.dtype else gpt2.DTYPES, phase,
                 memory_budget=args.memory_budget, families=args.families, mixed=args.mixed)
    print(json.dumps(r, indent=2) if args.json else gpt2.report(r))
    return 0


def at_least_one(flag: str, value: int) -> None:
    if value < 1:
        raise FlowError(f"{flag} must be at least 1, got {value}")


def check_bench_device(spec: str) -> None:
    from flowgrad.api import open_device

    # else the planner refuses a graph path the user never asked for by name
    if open_device(spec) is None:
        raise FlowError(f"bench times the graph path, which needs a Vulkan device: use --device vulkan or "
                        f"vulkan:N (device={spec!r} runs on numpy); --ranks N benches data-parallel steps "
                        "on any device")


def cmd_bench_matmul(args) -> int:
    from flowgrad.bench import matmul
    from flowgrad.exec_vulkan import select_device

    if args.dtype == "mixed":
        raise FlowError("bench matmul times one operand dtype: --dtype f32, f16 or bf16 (mixed runs its matmuls in "
                        "f16 or bf16, as `flowgrad devices` says)")
    device = select_device(args.device)
    if device is None:
        raise FlowError(f"bench matmul needs a Vulkan device; device={args.device!r} gave none")
    shapes = [matmul.parse_shape(s) for s in args.shape] or None
    chunks = matmul.parse_chunks(args.chunks) if args.chunks is not None else None
    rows = matmul.run(device, args.dtype, shapes, matmul.kernels_for(device, args.dtype, args.all, chunks))
    print(matmul.report(rows, device.info.name, args.dtype))
    return 0


EXAMPLES = {
    "check": "flowgrad check models/mlp.flow --set hidden=256",
    "explain": "flowgrad explain models/tiny_gpt.flow --device vulkan --analyze",
    "train": "flowgrad train models/mlp.flow --out runs/mlp --steps 400\n"
             "  flowgrad train models/mlp.flow --out runs/mlp --resume --steps 800",
    "run": "flowgrad run models/mlp.flow --checkpoint runs/mlp/checkpoint.safetensors --feed x=rows.csv "
           "--out pred.csv",
    "generate": "flowgrad generate models/char_lm.flow --checkpoint runs/char_lm/checkpoint.safetensors "
                "--prompt \"It was\" --tokens 100 --temperature 0.8 --top-k 10\n"
                "  flowgrad generate models/gan.flow --checkpoint runs/gan/checkpoint.safetensors --out digits.png",
    "export": "flowgrad export models/mlp.flow --checkpoint runs/mlp/checkpoint.safetensors -o mlp.onnx",
    "bench": "flowgrad bench --device vulkan --repeats 20\n  flowgrad bench matmul --dtype f16\n"
             "  flowgrad bench gpt2 --batch 16\n  flowgrad bench gpt2 --families",
    "devices": "flowgrad devices",
}


DESCRIPTION = """Train, run and export neural nets written in the .flow language.

`flowgrad COMMAND --help` shows each command's options and an example."""


def _sub(sub, name: str, help: str):
    return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                          epilog=f"example:\n  {EXAMPLES[name]}", formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    from flowgrad import __version__

    parser = argparse.ArgumentParser(prog="flowgrad", description=DESCRIPTION,
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
    p.add_argument("--ranks", type=int, default=None, metavar="N", help="describe data-parallel training on N ranks")
    add_budget_arg(p)
    p.set_defaults(func=cmd_explain)

    p = _sub(sub, "train", "train a model on the data named in its train section")
    add_model_args(p)
    add_session_args(p)
    add_budget_arg(p)
    p.add_argument("--steps", type=int, default=None, help="how many steps in all (default: the train "
                   "section's steps); with --resume, a number above the checkpoint's step trains further")
    p.add_argument("--out", default=None, metavar="DIR", help="directory for checkpoint.safetensors, "
                   "best.safetensors, metrics.jsonl and loss.png (default runs/MODEL)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--overwrite", action="store_true", help="start afresh even if --out holds a checkpoint")
    p.add_argument("--seed", type=int, default=None, help="seed of the param init, the data's split and order, "
                   "and dropout (default: the train section's seed, else the config's, else 0)")
    p.add_argument("--check-finite", action="store_true",
                   help="stop at the first non-finite loss or gradient, naming the node that produced it")
    p.add_argument("--ranks", type=int, default=None, metavar="N",
                   help="data-parallel on N ranks of this host (starts mpiexec; needs flowgrad[mpi])")
    p.add_argument("--check-every", type=int, default=None, metavar="STEPS",
                   help="data-parallel: steps between checks that all ranks hold the same params")
    p.set_defaults(func=cmd_train)
    p = _sub(sub, "run", "inference from a checkpoint, at any batch size")
    add_model_args(p)
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by `flowgrad train`; its config is "
                   "used, --set overrides it")
    p.add_argument("--feed", action="append", default=[], metavar="NAME=FILE",
                   help="an input from a .npy, .csv or single-array .npz file (rows first; any number of rows), "
                        "or FILE.npz whose arrays are named as the inputs; repeat per input. A model trained on "
                        "csv(..., na=, categorical=, standardize=) takes x=rows.csv with the training file's "
                        "columns, prepared as training prepared them")
    p.add_argument("--output", action="append", default=[], metavar="NAME", help="report only this output "
                   "(repeatable; default: every output the feeds determine)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the outputs to FILE: .npz (all), .npy (one) "
                   "or .csv (one column per value, one row per batch row); default: print them")
    p.add_argument("--device", default="auto", help="auto, cpu, vulkan or vulkan:N")
    p.add_argument("--seed", type=int, default=None, help="seed of the noise randn_like draws (default: the "
                   "config's seed, else 0)")
    p.set_defaults(func=cmd_run)

    p = _sub(sub, "generate", "sample text from a language model trained on text(...) data, or images from a "
                              "generative model (a GAN) as a PNG grid")
    add_model_args(p)
    p.add_argument("--checkpoint", required=True, help="a checkpoint of a trained model (a text model's holds the "
                   "vocab; a BPE model's tokenizer.json lies beside it)")
    p.add_argument("--prompt", default=None, help="text: the text to continue (required)")
    p.add_argument("--tokens", type=int, default=None, help="text: how many tokens to add (default 200)")
    p.add_argument("--temperature", type=float, default=None, help="text: softmax temperature; 0 always takes the "
                   "likeliest token (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="text: sample among the K likeliest tokens only "
                   "(default 0: all)")
    p.add_argument("--out", default=None, metavar="FILE.png", help="images: where to write the grid of samples "
                   "(required; needs matplotlib, the plot extra)")
    p.add_argument("--samples", type=int, default=None, help="images: how many to draw (default 64)")
    p.add_argument("--output", default=None, metavar="NAME", help="images: the output that holds them (default: "
                   "the first shaped as images)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed: the text's draws, the images' noise "
                   "(default 0)")
    p.add_argument("--device", default="auto", help="auto, cpu, vulkan or vulkan:N")
    p.set_defaults(func=cmd_generate)

    p = _sub(sub, "export", "write a trained model's forward graph as an ONNX file")
    add_model_args(p)
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by `flowgrad train`; its config is "
                   "used, --set overrides it")
    # --out as train and run spell it (a prefix of both long names, it was ambiguous)
    p.add_argument("-o", "--out", "--output-file", dest="output_file", required=True, metavar="FILE.onnx",
                   help="where to write the ONNX model")
    p.add_argument("--output", action="append", default=[], metavar="NAME", help="export this output (repeatable; "
                   "default: every output that does not read the targets)")
    p.add_argument("--fixed-batch", action="store_true", help="write the model at its batch size (--set batch=N) "
                   "instead of with a symbolic batch axis")
    p.add_argument("--device", default="cpu", help="where to load the params (default cpu)")
    p.set_defaults(func=cmd_export)

    p = _sub(sub, "devices", "list Vulkan devices")
    p.set_defaults(func=cmd_devices)

    p = _sub(sub, "bench", "graph vs closures step time on one device (the decoder example: tiny_gpt at d=64, "
                           "seq=64); `bench gpt2`: GPT-2 124M's shape against PyTorch")
    p.add_argument("file", nargs="?", default=None,
                   help="a .flow model or a shipped model's name (default: tiny_gpt at d=64, seq=64), "
                        "`matmul` for the GEMM kernels' TFLOP/s, or `gpt2` for tiny_gpt at GPT-2 124M's shape "
                        "(d=768, 12 heads, 12 layers, seq 1024, vocab 50304, batch 8) in f32 and mixed, "
                        "step time, tokens/s, MFU and memory beside its PyTorch twin on the CUDA GPU")
    p.add_argument("--compare", choices=["torch"], default=None,
                   help="also time the model's PyTorch twin on the CUDA GPU (eager and torch.compile)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override config values (repeatable): --set d=64 layers=1")
    p.add_argument("--device", default="vulkan",
                   help="vulkan or vulkan:N (default vulkan); with --ranks any device, cpu too")
    p.add_argument("--dtype", default=None, choices=["f32", "f16", "mixed", "bf16"],
                   help="compile dtype (default f32; bench matmul: f32, f16 or bf16, beside torch.matmul in that "
                        "dtype; bench gpt2: f32 or mixed, default both)")
    p.add_argument("--repeats", type=int, default=20, help="timed graph-path steps; closures get a quarter "
                   "(default 20)")
    p.add_argument("--steps", type=int, default=None, help="bench gpt2: timed steps per row (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="bench gpt2: untimed steps per row, at least "
                   "(default 5; each row also warms up for 1-10 s, until its steps stop getting faster)")
    p.add_argument("--batch", type=int, default=None, help="bench gpt2: the batch size (default 8)")
    p.add_argument("--mixed", default="auto", choices=list(MIXED_HALVES),
                   help="bench gpt2: what the mixed row computes in: bf16, f16, or auto (as --dtype mixed "
                        "chooses; default auto)")
    p.add_argument("--families", action="store_true",
                   help="bench gpt2: also the mixed-precision step's GPU time per kernel family (products, "
                        "attention, elementwise, layernorm, cross_entropy, embedding, casts, optimizer, transfers, "
                        "other), flowgrad's from its GPU timestamps beside PyTorch's bf16 autocast rows' from "
                        "torch.profiler (a CUDA GPU), ms per step and the ratio")
    p.add_argument("--shape", action="append", default=[], metavar="M,N,K[,nn|nt|tn]",
                   help="bench matmul: a product to time (default: 4096^3 and gpt_small's)")
    p.add_argument("--all", action="store_true", help="bench matmul: time every kernel, not only the chosen one")
    p.add_argument("--chunks", default=None, metavar="C1,C2,...",
                   help="bench matmul: time each kernel split over K into each of these chunk counts "
                        "(default: as the lowering splits)")
    p.add_argument("--ranks", type=int, default=None, metavar="N",
                   help="data-parallel training steps at 1..N ranks (mpiexec): step time, samples/s, all-reduce share")
    add_budget_arg(p)
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
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
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
