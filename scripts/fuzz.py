"""Fuzz the language, the config overrides, the feeds and the API.

    python scripts/fuzz.py --n 500 --seed 1 [--jobs 2] [--case 17] [--device cpu]

Each case is made from (seed, index) alone, so `--case I` replays one. Kinds:
  mutate   token and character mutations of the example models
  grammar  programs generated from the grammar, with random ops and shapes
  typed    mostly well-typed generated programs, so that steps run
  set      the example models with bad or extreme config overrides
  feed     a compiled example model stepped with bad feeds
  api      misuse of the Python API (bad arguments, bad values)
  train    mutations of an example model's train section, then two training
           steps (data sources, optimizers, schedules, metrics, checkpoints)

Every case ends in one of: `error` (a FlowError whose caret sits on the line
and column it names), `valid`, `caret` (a FlowError pointing elsewhere),
`other` (any other exception), `crash` (the worker died) or `hang` (more than
--timeout seconds of CPU, or ten times that of wall time). Cases run in worker processes with a memory cap, so a hang
or an allocation storm costs one case. Exit status 1 when any case is not
`error` or `valid`.
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import random
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "flowgrad" / "models"
BAD = ("caret", "other", "crash", "hang")
TRAIN_BLOCK = "\ntrain {"

WEIRD_CHARS = ["\x0c", "\r", "\x85", "\u2028", "\t", "\x00", "\u00e9", "\ufeff", "\\", "\"", "'", "#", "\n"]
PUNCT = list("()[]{},:=+-*/@.") + ["**", "->", "\n  ", "  "]
NUMBERS = ["0", "1", "-1", "2", "3", "7", "0.5", "1e-3", "1e400", "1e-400", "10**9", "100000", "2**31",
           "9" * 40, "9" * 5000, "1." + "0" * 300, ".5e", "1e", "nan", "inf", "-0", "4294967297"]
WORDS = ["model", "config", "input", "param", "block", "return", "output", "minimize", "train", "repeat",
         "split", "true", "false", "none", "f32", "f16", "i32", "float", "x", "y", "h", "w1", "b1",
         "d", "heads", "batch", "seq", "vocab", "zeros", "ones", "normal", "xavier", "uniform", "axis",
         "keepdims", "causal", "mask", "shape", "dims", "dtype"]


def example_texts() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(MODELS.glob("*.flow"))}


def op_names() -> list[str]:
    from flowgrad.ops import OPS

    return sorted(OPS)


# ---------------------------------------------------------------- case makers

def tokens_of(text: str) -> list[tuple[int, int]]:
    """(start, end) of each word, number and punctuation run."""
    import re

    return [m.span() for m in re.finditer(r"[A-Za-z_][A-Za-z_0-9]*|\d+\.?\d*(?:[eE][+-]?\d+)?|\S", text)]


def mutate(rng: random.Random, text: str) -> str:
    pool = WORDS + op_names() + NUMBERS + PUNCT
    for _ in range(rng.randint(1, 4)):
        spans = tokens_of(text)
        if not spans:
            text += rng.choice(pool)
            continue
        a, b = rng.choice(spans)
        how = rng.randrange(9)
        if how == 0:
            text = text[:a] + text[b:]
        elif how == 1:
            text = text[:a] + rng.choice(pool) + text[b:]
        elif how == 2:
            text = text[:a] + rng.choice(pool) + " " + text[a:]
        elif how == 3:
            i = rng.randrange(len(text) + 1)
            text = text[:i] + rng.choice(WEIRD_CHARS + PUNCT) + text[i:]
        elif how == 4 and len(text) > 1:
            i = rng.randrange(len(text))
            text = text[:i] + text[i + 1:]
        elif how == 5:
            lines = text.split("\n")
            i = rng.randrange(len(lines))
            lines.insert(rng.randrange(len(lines) + 1), lines[i])
            text = "\n".join(lines)
        elif how == 6:
            lines = text.split("\n")
            del lines[rng.randrange(len(lines))]
            text = "\n".join(lines)
        elif how == 7:
            text = text[:a] + rng.choice(NUMBERS) + text[b:]
        else:
            text = text[:a] + text[a:b] * rng.randint(2, 60) + text[b:]
    return text


def gen_expr(rng: random.Random, names: list[str], depth: int) -> str:
    if depth <= 0 or rng.random() < 0.3:
        return rng.choice(names + [rng.choice(NUMBERS[:8])])
    r = rng.random()
    if r < 0.35:
        op = rng.choice(["+", "-", "*", "/", "@", "**"])
        return f"{gen_expr(rng, names, depth - 1)} {op} {gen_expr(rng, names, depth - 1)}"
    if r < 0.45:
        return f"-({gen_expr(rng, names, depth - 1)})"
    if r < 0.5:
        return f"({gen_expr(rng, names, depth - 1)})"
    from flowgrad.ops import OPS

    op = OPS[rng.choice(op_names())]
    args = []
    for a in op.args:
        if a.kind == "attr":
            if a.default != "<required>" and rng.random() < 0.6:
                continue
            val = rng.choice(["-1", "0", "1", "2", "3", "true", "false", "f32", "i32", "[1, 2]",
                              "[2, -1]", "[0, 1, 2]", '"tanh"', "none", "4", "1e-5", "d"])
            args.append(f"{a.name}={val}")
        elif a.default is None and rng.random() < 0.7:
            continue
        else:
            args.append(gen_expr(rng, names, depth - 1))
    return f"{op.name}({', '.join(args)})"


def gen_program(rng: random.Random) -> str:
    dims = {"b": rng.choice([1, 2, 3, 4]), "d": rng.choice([1, 2, 4, 8]), "k": rng.choice([1, 3, 5])}
    lines = [f"model g{rng.randrange(1000)}", "config {"] + [f"  {k} = {v}" for k, v in dims.items()] + ["}"]
    names = []
    for i in range(rng.randint(1, 3)):
        shape = ", ".join(rng.choice(["b", "d", "k", "1", "2"]) for _ in range(rng.randint(0, 3)))
        dtype = rng.choice(["f32", "f32", "f32", "i32", "f16"])
        lines.append(f"input in{i}: {dtype}[{shape}]")
        names.append(f"in{i}")
    for i in range(rng.randint(0, 3)):
        shape = ", ".join(rng.choice(["b", "d", "k", "1"]) for _ in range(rng.randint(0, 3)))
        init = rng.choice(["zeros()", "ones()", "normal(std=0.1)", "xavier()", "uniform(-1, 1)"])
        lines.append(f"param p{i}: f32[{shape}] = {init}")
        names.append(f"p{i}")
    if rng.random() < 0.4:
        body = [f"  t = {gen_expr(rng, ['a', 'd'], 2)}", "  return t"]
        lines += ["block blk(a) {", *body, "}"]
        lines.append(f"r = repeat({rng.choice(['0', '1', '2', 'k'])}, blk, {rng.choice(names)})")
        names.append("r")
    for i in range(rng.randint(1, 4)):
        lines.append(f"v{i} = {gen_expr(rng, names, rng.randint(1, 4))}")
        names.append(f"v{i}")
    last = names[-1]
    lines.append(f"output {last}")
    if rng.random() < 0.7:
        lines.append(f"loss = {rng.choice(['sum', 'mean'])}({last})")
        lines.append("minimize loss")
    return "\n".join(lines) + "\n"


UNARY = ["relu", "tanh", "sigmoid", "exp", "log", "sqrt", "silu", "gelu", "neg", "softmax", "log_softmax"]


def gen_typed(rng: random.Random) -> str:
    """A program that is mostly well typed: [b, d] tensors through
    shape-keeping ops, so cases get past the builder and run a step."""
    b, d = rng.choice([1, 2, 3]), rng.choice([1, 2, 4])
    lines = [f"config {{\n  b = {b}\n  d = {d}\n}}", "input x: f32[b, d]", "param w: f32[d, d] = normal(std=0.5)",
             "param g: f32[d] = ones()", "param c: f32[d] = zeros()"]
    names = ["x"]
    for i in range(rng.randint(1, 6)):
        a, z = rng.choice(names), rng.choice(names)
        form = rng.choice([
            f"{rng.choice(UNARY)}({a})", f"{a} {rng.choice('+-*/')} {z}", f"{a} @ w", f"{a} + c",
            f"layernorm({a}, g, c)", f"rmsnorm({a}, g)", f"{a} ** {rng.choice(['0', '2', '0.5', '-1', '3'])}",
            f"{a} * {rng.choice(NUMBERS[:8])}", f"transpose(transpose({a}))",
            f"max({a}, axis=-1, keepdims=true) + {z}", f"mean({a}, axis=0, keepdims=true) * {z}",
            f"cast(cast({a}, f16), f32)", f"concat({a}, {z}, axis=0)", f"slice({a}, axis=1, start=0, stop=1) * {z}",
        ])
        lines.append(f"v{i} = {form}")
        names.append(f"v{i}")
    last = names[-1]
    loss = rng.choice([f"sum({last})", f"mean({last})", f"mse_loss({last}, {last} * 0.5)", f"sum({last} * {last})"])
    lines += [f"loss = {loss}", f"output {last}", "minimize loss"]
    return "\n".join(lines) + "\n"


def bad_value(rng: random.Random):
    return rng.choice([
        "abc", "", "1e400", "-1e400", "10**9", "1000000000", "100000", "-1", "0", "nan", "inf", "-inf",
        "true", "9" * 5000, "1" + "0" * 30, "2.5", "f16", "i32", "[1,2]", "\x00", "\u2028", " 3 ",
        10 ** 9, -1, 0, 2.5, float("nan"), float("inf"), True, None, [1, 2], {"a": 1}, 2 ** 70, b"3",
    ])


def config_keys(text: str) -> list[str]:
    import re

    block = re.search(r"config \{(.*?)\}", text, re.S)
    return re.findall(r"^\s*([A-Za-z_]\w*)\s*=", block.group(1), re.M) if block else []


def make_case(seed: int, index: int) -> dict:
    rng = random.Random(f"{seed}:{index}")
    texts = example_texts()
    name = rng.choice(sorted(texts))
    kind = rng.choices(["mutate", "grammar", "typed", "set", "feed", "api", "train"],
                       weights=[40, 15, 15, 12, 12, 6, 10])[0]
    if kind == "train":
        name = rng.choice(sorted(n for n, t in texts.items() if TRAIN_BLOCK in t))
    case = {"kind": kind, "index": index, "file": f"fuzz{index}.flow", "config": {}, "text": texts[name],
            "model": name}
    if kind == "mutate":
        case["text"] = mutate(rng, texts[name])
    elif kind == "grammar":
        case["text"] = gen_program(rng)
    elif kind == "typed":
        case["text"] = gen_typed(rng)
    elif kind == "set":
        keys = config_keys(texts[name])
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(keys + ["nope", "", "1x"]) if rng.random() < 0.9 else rng.choice(keys + [3])
            case["config"][key] = bad_value(rng)
        case["via_cli"] = rng.random() < 0.5 and all(isinstance(v, str) for v in case["config"].values())
    elif kind == "feed":
        case["feed"] = rng.randrange(1 << 30)
    elif kind == "train":
        # the data paths are relative to the model file, so the case is named as if it sat beside it
        case["file"] = str(MODELS / f"fuzz{index}.flow")
        at = texts[name].index(TRAIN_BLOCK)
        case["text"] = texts[name][:at] + mutate(rng, texts[name][at:])
        case["write"] = rng.random() < 0.3
    else:
        case["api"] = rng.randrange(1 << 30)
    return case


# ---------------------------------------------------------------- running a case

def small_config(name: str) -> dict:
    return {"tiny_gpt": {"d": 16, "layers": 1, "batch": 2, "seq": 8, "heads": 2}}.get(name, {"batch": 4})


def random_feeds(sess, rng):
    import numpy as np

    feeds = {}
    for name, nid in sess.graph.inputs.items():
        node = sess.graph.nodes[nid]
        if node.dtype == "i32":
            bound = min((n for n, _ in sess._index_uses.get(nid, ())), default=3)
            feeds[name] = rng.integers(0, bound, node.shape).astype(np.int32)
        else:
            feeds[name] = rng.standard_normal(node.shape).astype(np.float32)
    return feeds


def bad_feeds(sess, r: random.Random):
    import numpy as np

    good = random_feeds(sess, np.random.default_rng(r.randrange(1 << 30)))
    feeds = dict(good)
    name = r.choice(sorted(feeds))
    arr = feeds[name]
    choice = r.randrange(16)
    if choice == 0:
        feeds[name] = np.zeros(arr.shape + (1,), arr.dtype)
    elif choice == 1:
        feeds[name] = arr.astype(np.complex64)
    elif choice == 2:
        feeds[name] = arr.astype(object)
    elif choice == 3:
        feeds[name] = None
    elif choice == 4:
        feeds[name] = arr.tolist()
    elif choice == 5:
        del feeds[name]
    elif choice == 6:
        feeds["nope"] = arr
    elif choice == 7:
        feeds[3] = arr
    elif choice == 8:
        feeds[name] = np.full(arr.shape, 2 ** 32 + 1, np.int64)
    elif choice == 9:
        feeds[name] = np.full(arr.shape, -1, arr.dtype)
    elif choice == 10:
        feeds[name] = np.full(arr.shape, np.nan, np.float64)
    elif choice == 11:
        feeds[name] = "abc"
    elif choice == 12:
        feeds[name] = np.asarray(3.0)
    elif choice == 13:
        return None
    elif choice == 14:
        return [arr]
    else:
        feeds[name] = np.full(arr.shape, 10 ** 6, np.int64)
    return feeds


def api_misuse(model, r: random.Random):
    import numpy as np

    import flowgrad as fg

    choice = r.randrange(12)
    if choice == 0:
        return model.compile(device="cpu", backward=r.choice(["foo", None, 3, "Graph"]))
    if choice == 1:
        return model.compile(device="cpu", seed=r.choice([-1, 2 ** 70, "x", 1.5, None]))
    if choice == 2:
        return fg.loads(r.choice([b"model x\n", None, 3, ["model x"]]))
    if choice == 3:
        return model.compile(device=r.choice(["gpu", "", None, 0, "vulkan:x", "cpu "]))
    if choice == 4:
        return model.compile(device="cpu", dtype=r.choice(["f64", None, "i32", 32]))
    if choice == 5:
        return model.with_config(**{r.choice(["batch", "zz"]): bad_value(r)})
    sess = model.compile(device="cpu")
    name = r.choice(sorted(sess.graph.params))
    shape = sess.graph.nodes[sess.graph.params[name]].shape
    if choice == 6:
        return sess.step(r.choice([None, [], 3, "x"]))
    if choice == 7:
        return sess.set_params({name: np.empty(shape, object)})
    if choice == 8:
        return sess.set_params(r.choice([None, [1], {3: 1}, {name: "abc"}, {name: np.zeros(shape, np.complex64)}]))
    if choice == 9:
        return sess.load_checkpoint(r.choice(["/nonexistent/ck.safetensors", "/", None, 3]))
    if choice == 10:
        return sess.step(random_feeds(sess, np.random.default_rng(0)), optimizer=r.choice(["sgd", 3, object()]))
    return sess.step(random_feeds(sess, np.random.default_rng(0)), grads=r.choice(["yes", None]))


def run_case(case: dict, device: str) -> None:
    import numpy as np

    import flowgrad as fg
    from flowgrad.cli import parse_sets

    text, config = case["text"], case["config"]
    if case["kind"] in ("feed", "api"):
        config = small_config(case["model"])
    r = random.Random(case.get("feed", case.get("api", 0)))
    if case.get("via_cli"):
        config = parse_sets([f"{k}={v}" for k, v in config.items()])
    model = fg.loads(text, config, file=case["file"])
    if case["kind"] == "api":
        api_misuse(model, r)
        return
    if case["kind"] == "train":
        import tempfile

        with tempfile.TemporaryDirectory() as out:
            fg.train(model, steps=2, device=device, progress=False, out=out if case["write"] else None)
        return
    sess = model.compile(device=device)
    if case["kind"] == "feed":
        sess.step(bad_feeds(sess, r), grads=sess.graph.loss is not None)
        return
    if sum(n.type.size for n in sess.graph.nodes) < 5_000_000:
        sess.step(random_feeds(sess, np.random.default_rng(0)), grads=sess.graph.loss is not None)


def caret_problem(err, text: str) -> str | None:
    """Where a FlowError's caret disagrees with the line:col it names."""
    from flowgrad.dsl.source import line_text

    lines = [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]   # "\r\n" ends a line too
    for span in (err.span, *err.span.via):
        if span.file != err.span.file:
            continue
        if not 1 <= span.line <= len(lines):
            return f"line {span.line} is outside the file's {len(lines)} lines"
        want = line_text(lines, span.line)
        if span.text != want:
            return f"caret shows {span.text!r}, line {span.line} is {want!r}"
        if not 1 <= span.col <= len(want) + 1:
            return f"column {span.col} is outside line {span.line} ({len(want)} characters)"
    first = str(err).split("\n", 1)[0]
    if not first.startswith(err.span.where()):
        return f"message starts {first[:60]!r}, not with {err.span.where()}"
    return None


def classify(case: dict, device: str) -> tuple[str, str]:
    from flowgrad.errors import FlowError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            run_case(case, device)
        except FlowError as err:
            if err.span is not None and case["kind"] in ("mutate", "grammar", "typed", "set", "train"):
                problem = caret_problem(err, case["text"])
                if problem:
                    return "caret", f"{problem}: {err.message[:120]}"
            try:
                str(err)
            except Exception as e:  # noqa: BLE001 - a message that cannot be shown is a bug too
                return "other", f"str(FlowError) raised {type(e).__name__}: {e}"
            return "error", err.message[:80]
        except BaseException as err:  # noqa: BLE001 - classifying everything is the point
            if isinstance(err, KeyboardInterrupt):
                raise
            frame = traceback.extract_tb(err.__traceback__)[-1]
            where = f"{Path(frame.filename).name}:{frame.lineno}"
            return "other", f"{type(err).__name__} at {where}: {str(err)[:160]}"
    return "valid", ""


def mapped_bytes() -> int:
    """This process's virtual size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def worker(conn, seed: int, device: str, mem_bytes: int):
    import resource

    from threadpoolctl import threadpool_limits  # scikit-learn's dependency

    # workers run side by side, a core each: BLAS threads of their own would
    # spin against each other and turn a 1 s case into a 10 s "hang"
    threadpool_limits(1)

    if mem_bytes:
        # on top of what the interpreter maps already: that differs by machine (thread
        # stacks and BLAS buffers per core, packages imported), so an absolute cap
        # would leave a 16-core machine less room than a 2-core one
        cap = mapped_bytes() + mem_bytes
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    parent = os.getppid()
    while True:
        while not conn.poll(1.0):
            if os.getppid() != parent:   # the runner died: don't linger
                return
        index = conn.recv()
        if index is None:
            return
        conn.send(classify(make_case(seed, index), device))


class Worker:
    def __init__(self, ctx, seed, device, mem_bytes):
        self.args = (ctx, seed, device, mem_bytes)
        self.start()

    def start(self):
        ctx, seed, device, mem_bytes = self.args
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(child, seed, device, mem_bytes), daemon=True)
        self.proc.start()
        self.index, self.since = None, 0.0

    def submit(self, index):
        self.index, self.since, self.cpu_since = index, time.monotonic(), self.cpu()
        self.conn.send(index)

    def cpu(self) -> float:
        """CPU seconds the worker has used (Linux /proc; wall time elsewhere)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return time.monotonic()

    def hung(self, now: float, timeout: float) -> bool:
        """Over `timeout` CPU seconds on this case (so a machine shared with
        other work does not count its waits as hangs), or over ten times that
        in wall time (a case blocked without computing)."""
        return now - self.since > timeout and (self.cpu() - self.cpu_since > timeout
                                               or now - self.since > 10 * timeout)

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()


def run(n: int, seed: int, jobs: int, timeout: float, device: str, mem_mb: int, start: int = 0,
        progress: bool = False) -> dict:
    ctx = mp.get_context("fork")
    workers = [Worker(ctx, seed, device, mem_mb << 20) for _ in range(jobs)]
    todo = collections.deque(range(start, start + n))
    results: dict[int, tuple[str, str]] = {}
    t0 = time.monotonic()
    for w in workers:
        if todo:
            w.submit(todo.popleft())
    try:
        _drive(workers, todo, results, timeout, progress, t0)
    except KeyboardInterrupt:
        print(f"interrupted: reporting the {len(results)} cases done", file=sys.stderr)
    for w in workers:
        w.kill()
    return {"results": results, "seconds": time.monotonic() - t0, "seed": seed}


def _drive(workers, todo, results, timeout, progress, t0):
    from multiprocessing.connection import wait

    while any(w.index is not None for w in workers):
        busy = [w for w in workers if w.index is not None]
        ready = wait([w.conn for w in busy], timeout=0.2)
        now = time.monotonic()
        for w in busy:
            index, outcome = w.index, None
            if w.conn in ready:
                try:
                    outcome = w.conn.recv()
                except EOFError:
                    outcome = ("crash", f"worker died (exit {w.proc.exitcode})")
                    w.kill()
                    w.start()
            elif w.hung(now, timeout):
                outcome = ("hang", f"over {timeout:g} s")
                w.kill()
                w.start()
            if outcome is None:
                continue
            results[index] = outcome
            w.index = None
            if todo:
                w.submit(todo.popleft())
        if progress and len(results) % 1000 == 0 and results:
            print(f"  {len(results)} cases, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)


def report(summary: dict, limit: int = 30) -> str:
    results = summary["results"]
    kinds = collections.Counter()
    by_outcome = collections.Counter(o for o, _ in results.values())
    for i, (outcome, _) in results.items():
        kinds[(make_case(summary["seed"], i)["kind"] if outcome in BAD else "", outcome)] += 1
    lines = [f"{len(results)} cases in {summary['seconds']:.1f} s (seed {summary['seed']}): "
             + ", ".join(f"{by_outcome[o]} {o}" for o in ("error", "valid", *BAD))]
    seen = collections.OrderedDict()
    for i in sorted(results):
        outcome, detail = results[i]
        if outcome in BAD:
            key = (outcome, detail.split(":")[0] if outcome == "other" else outcome, detail[:70])
            seen.setdefault(key, []).append(i)
    for (outcome, _, detail), cases in list(seen.items())[:limit]:
        lines.append(f"  {outcome:<6} x{len(cases):<4} e.g. --case {cases[0]}: {results[cases[0]][1][:200]}")
    return "\n".join(lines)


def _interrupt(*_):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--start", type=int, default=0, help="first case index")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)))
    p.add_argument("--timeout", type=float, default=5.0, help="seconds a case may take")
    p.add_argument("--device", default="cpu")
    p.add_argument("--mem-mb", type=int, default=3072, help="address space a worker may map beyond what it maps at start")
    p.add_argument("--case", type=int, help="run one case here and show it")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.case is not None:
        case = make_case(args.seed, args.case)
        print(f"kind {case['kind']}, config {case['config']!r}\n----\n{case['text']}\n----")
        try:
            run_case(case, args.device)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            print(f"\n{err}")
        print(classify(case, args.device))
        return 0
    signal.signal(signal.SIGTERM, _interrupt)   # `kill` reports the cases done so far, as Ctrl-C does
    summary = run(args.n, args.seed, args.jobs, args.timeout, args.device, args.mem_mb, args.start,
                  progress=args.n >= 5000)
    print(report(summary))
    return 1 if any(o in BAD for o, _ in summary["results"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
