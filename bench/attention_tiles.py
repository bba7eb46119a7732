#!/usr/bin/env python3
"""GPU time of each attention kernel (forward, dq pass, dk/dv pass) for the
tile configuration the shipped table holds, with SDPA's forward and backward
on the same GPU in the same process. For a tile sweep, build candidate
tables elsewhere and run this once per candidate with its .spv files in place:

    python bench/attention_tiles.py [--steps 20] [--json OUT] [--label NAME] [--dtype f16]

--dtype f16 (or bf16) times the kernels f16 (bf16) storage runs on the device: on cooperative
matrices where it has them (their candidate table: --coop); --builds khr,cm2
times both cooperative-matrix builds of each case in turn (cm2 only where the
device offers VK_NV_cooperative_matrix2's reductions and conversions);
--case B,T,H,causal (repeatable) replaces the list of cases, e.g. GPT-2's
--case 8,1024,12,1.

Candidate attn_cm2 builds (other defines of the shipped .glsl bodies, or an older
body) are compiled here, since the GPU machine has no glslc, and timed there as
builds of their own:

    python bench/attention_tiles.py --build-candidates CANDIDATES.json DIR      # here
    python bench/attention_tiles.py --candidates DIR --builds cm2,cand:NAME ... # on the GPU

CANDIDATES.json maps NAME to {"kernel": "fwd" | "bwd_dq" | "bwd_dkdv", "defines":
{...} (over the shipped build's, at --maxd and --cand-shape, by default NVIDIA's
16x16 fragments with subgroups of 32), optionally "source": a .glsl path (default
the shipped body)}; cand:NAME runs the cm2 builds with NAME in
place of its kernel's. With FLOWGRAD_VK_PIPELINE_STATS=1 each build's registers
and spills are printed.

Forward and backward of each case are recorded into one command buffer (the
graph path's order, so the dq pass reads the forward's lse), every dispatch
timed by GPU timestamps (medians over --steps submits); every case's output
and gradients are checked against float64 numpy, and a case past CHECK_TOL is
marked WRONG."""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
from pathlib import Path

import attrs
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASES = [  # batch, seq, heads, causal (head width: --maxd)
    (1, 1024, 8, True),
    (16, 256, 8, True),
    (4, 1024, 8, True),
    (1, 1024, 8, False),
    (2, 1031, 8, True),   # partial query and key tiles
]
BUILDS = {"auto": None, "khr": False, "cm2": True}   # --builds: how forced_cm2 is set
CAND_SHAPE = (16, 32)   # the fragment shape and subgroup size candidates are built for (NVIDIA's)
CHECK_TOL = {"f32": 1e-4, "f16": 2e-2, "bf16": 4e-2}   # relative error above which a case is marked WRONG


@functools.cache
def reference(case):
    """The float64 output and gradients of a case's inputs (those ours() makes)."""
    from flowgrad.dtypes import as_dtype
    from flowgrad.ops import get_op

    batch, seq, heads, dh, causal, dtype = case
    attrs_ = {"heads": heads, "causal": causal}
    rng = np.random.default_rng(0)
    q, k, v, g = (as_dtype(rng.standard_normal((batch, seq, heads * dh)), dtype) for _ in range(4))
    op = get_op("attention")
    wide = [x.astype(np.float64) for x in (q, k, v)]
    ref = op.forward(wide, attrs_)
    return [ref, *op.vjp(g.astype(np.float64), wide, ref, attrs_)[:3]]


def ours(device, case, steps):
    from flowgrad.dtypes import as_dtype
    from flowgrad.exec_vulkan.encoder import encode, read_timestamps
    from flowgrad.exec_vulkan.lower import attention as attn_low
    from flowgrad.exec_vulkan.oneshot import OneShot
    from flowgrad.graph import Node, TensorType
    from flowgrad.ops import get_op

    batch, seq, heads, dh, causal, dtype = case
    attrs_ = {"heads": heads, "causal": causal}
    rng = np.random.default_rng(0)
    q, k, v, g = (as_dtype(rng.standard_normal((batch, seq, heads * dh)), dtype) for _ in range(4))
    t = TensorType(q.shape, dtype)
    node = Node(3, "attention", (0, 1, 2), t, attrs=attrs_)
    # attention_grad's inputs: q, k, v, the attention's output (node 3), g (node 4); dq, dk, dv packed
    grad_node = Node(5, "attention_grad", (0, 1, 2, 3, 4), TensorType((3 * q.size,), dtype),
                     attrs=get_op("attention_grad").with_defaults(attrs_), grad_of=3)
    with OneShot(device) as s:
        views = [s.upload(x, dtype) for x in (q, k, v)]
        out, gv = s.empty(q.shape, dtype), s.upload(g, dtype)
        packed = s.empty((3 * q.size,), dtype)
        grads = [packed.view(i * q.size, q.shape) for i in range(3)]
        with s.rec.section("a", "forward"):
            attn_low.ATTENTION.forward(s.rec, node, views, out)
        with s.rec.section("a", "backward"):
            attn_low.attention_grad_forward(s.rec, grad_node, [*views, out, gv], packed)
        # one timestamp interval per dispatch
        cmds = [attrs.evolve(c, label=(c.shader, str(i))) if hasattr(c, "shader") else c
                for i, c in enumerate(s.rec.commands)]
        for x in (out, *grads):
            s.download(x)
        got = s.run()
        want = reference(case)
        err = max(float(np.abs(a - w).max() / np.abs(w).max()) for a, w in zip(got, want))
        s.rec.arena.materialize(device, device.pool)
        cmd = device.command_buffer()
        enc = encode(device, cmd, cmds, timestamps=True)
        times: dict[str, list] = {}
        try:
            for _ in range(steps + 2):
                device.submit_and_wait(cmd, "timing attention")
                per = {}
                for label, sec in read_timestamps(device, enc):
                    if label is not None:  # not the uploads' copies
                        per[label[0]] = per.get(label[0], 0.0) + sec
                for shader, sec in per.items():
                    times.setdefault(shader, []).append(sec)
        finally:
            enc.free()
            device.free_command_buffer(cmd)
    return {sh: statistics.median(ts[2:]) for sh, ts in times.items()}, err


def sdpa(case, steps):
    import torch
    import torch.nn.functional as F

    batch, seq, heads, dh, causal, dtype = case
    dt = getattr(torch, {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype])
    q, k, v = (torch.randn(batch, heads, seq, dh, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    g = torch.randn(batch, heads, seq, dh, device="cuda", dtype=dt)

    def timed(back):
        times = []
        for i in range(steps + 3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if back:
                out.backward(g)
            b.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)

    fwd = timed(False)
    return fwd, timed(True) - fwd


def cand_stem(name: str, kernel: str, maxd: int) -> str:
    return f"attn_cand_{kernel}_{name}_d{maxd}"


def build_candidates(table_path: Path, out: Path, maxd: int, shape=CAND_SHAPE) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import build_shaders

    from flowgrad.exec_vulkan.attention_builds import cm2_builds, cm2_name

    table = json.loads(table_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    shipped = cm2_builds()
    for name, c in table.items():
        body, defines = shipped[cm2_name(c["kernel"], maxd, *shape)]
        source = Path(c["source"]) if "source" in c else build_shaders.SHADER_DIR / body
        merged = {**defines, **c.get("defines", {})}
        c["rows"] = merged["NSG"] * merged.get("RF", 1) * merged["FR"]
        flags = [f"-D{k}={v}" for k, v in merged.items()]
        build_shaders.compile_one(source, flags, out / f"{cand_stem(name, c['kernel'], maxd)}.spv")
        print(f"built {name}", flush=True)
    (out / "candidates.json").write_text(json.dumps({"maxd": maxd, "shape": shape, "builds": table}, indent=1))


@contextlib.contextmanager
def candidate(folder: Path, name: str):
    """The cm2 builds with candidate NAME (built into folder) in place of its kernel's."""
    from flowgrad.exec_vulkan import push_constants, spirv
    from flowgrad.exec_vulkan.lower import attention as attn_low

    listing = json.loads((folder / "candidates.json").read_text())
    c = listing["builds"][name]
    stem = cand_stem(name, c["kernel"], listing["maxd"])
    saved = (spirv.spv_path, attn_low.cm2_name, attn_low.cm2_rows)
    push_constants.SPECS[stem] = push_constants.SPECS[saved[1](c["kernel"], listing["maxd"], *listing["shape"])]
    spirv.spv_path = lambda shader, variant=None: folder / f"{shader}.spv" if shader == stem else saved[0](shader, variant)
    attn_low.cm2_name = lambda kernel, *a: stem if kernel == c["kernel"] else saved[1](kernel, *a)
    attn_low.cm2_rows = lambda fr, sg, maxd, kernel: c["rows"] if kernel == c["kernel"] else saved[2](fr, sg, maxd, kernel)
    try:
        with attn_low.forced_cm2(True):
            yield stem
    finally:
        spirv.spv_path, attn_low.cm2_name, attn_low.cm2_rows = saved


def main(argv=None) -> int:
    from flowgrad.exec_vulkan import select_device
    from flowgrad.exec_vulkan.lower import attention as attn_low

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--label", default="shipped")
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--maxd", type=int, default=64, choices=sorted(attn_low.TILES),
                   help="the build to time, at head width MAXD")
    p.add_argument("--tiles", default=None, help='JSON {"fwd": [BR, BC, CT, SLOTS], ...} for the MAXD builds '
                   "in place (a candidate table's, not the shipped one)")
    p.add_argument("--dtype", default="f32", choices=("f32", "f16", "bf16"))
    p.add_argument("--coop", default=None, help='JSON {"fwd": [NSG, BC], ...} for the MAXD cooperative-matrix '
                   "builds of the device's fragment shape in place (a candidate table's)")
    p.add_argument("--builds", default="auto", help="comma-separated: auto (the device's pick), khr, cm2")
    p.add_argument("--case", action="append", default=None, help="B,T,H,causal (replaces the default cases)")
    p.add_argument("--build-candidates", nargs=2, metavar=("JSON", "DIR"), default=None)
    p.add_argument("--cand-shape", default="16,32", help="FR,SG the candidates are built for")
    p.add_argument("--candidates", default=None, help="DIR of candidate builds (cand:NAME in --builds)")
    args = p.parse_args(argv)
    if args.build_candidates:
        build_candidates(Path(args.build_candidates[0]), Path(args.build_candidates[1]), args.maxd,
                         tuple(int(x) for x in args.cand_shape.split(",")))
        return 0
    cases = [tuple(int(x) for x in c.split(",")) for c in args.case] if args.case else CASES
    if args.tiles:
        attn_low.TILES[args.maxd].update({k: tuple(v) for k, v in json.loads(args.tiles).items()})
    device = select_device("vulkan")
    if args.coop:
        fr, sg, _maxd = attn_low.coop_build(device.info, args.maxd)
        attn_low.COOP_TILES[(fr, sg)][args.maxd].update({k: tuple(v) for k, v in json.loads(args.coop).items()})
    if device.capture_stats:
        shipped = [attn_low.cm2_name(kernel, args.maxd, *CAND_SHAPE) for kernel in attn_low.CM2_BODIES]
        cands = json.loads((Path(args.candidates) / "candidates.json").read_text())["builds"] if args.candidates else {}
        for name in [*shipped, *cands]:
            with candidate(Path(args.candidates), name) if name in cands else contextlib.nullcontext(name) as stem:
                try:
                    stats = device.pipeline_statistics(stem)
                    print(f"pipeline {name}:", {k: v for k, v in stats.items() if "Register" in k or "pill" in k
                                                 or "Memory" in k}, flush=True)
                except Exception as e:  # noqa: BLE001 - statistics are optional
                    print(f"pipeline {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    rows = []
    for batch, seq, heads, causal in cases:
        case = (batch, seq, heads, args.maxd, bool(causal), args.dtype)
        ref = (float("nan"), float("nan"))
        if not args.no_sdpa:
            try:
                ref = sdpa(case, args.steps)
            except Exception as e:  # noqa: BLE001 - our numbers stand without torch
                print(f"sdpa unavailable: {e}", file=sys.stderr)
        for build in args.builds.split(","):
            try:
                if build.startswith("cand:"):
                    ctx = candidate(Path(args.candidates), build[5:])
                else:
                    ctx = attn_low.forced_cm2(BUILDS[build]) if BUILDS[build] is not None else contextlib.nullcontext()
                with ctx:
                    kern, err = ours(device, case, args.steps)
            except Exception as e:  # noqa: BLE001 - the other builds' numbers stand
                print(f"[{args.label} {build}] failed: {e}", file=sys.stderr)
                continue
            fwd = sum(t for sh, t in kern.items() if "fwd" in sh)
            bwd = sum(t for sh, t in kern.items() if "bwd" in sh)
            rows.append({"label": args.label, "build": build, "case": case, "tiles": attn_low.TILES[args.maxd],
                         "ms": {k: v * 1e3 for k, v in kern.items()}, "sdpa_ms": [x * 1e3 for x in ref],
                         "ratio": (fwd + bwd) / sum(ref), "fwd_ratio": fwd / ref[0], "bwd_ratio": bwd / ref[1],
                         "err": err})
            parts = " ".join(f"{sh[5:sh.rindex('_d')]} {t * 1e3:.3f}" for sh, t in kern.items())
            print(f"[{args.label} {build}] b{case[0]} T{case[1]} h{case[2]} hd{case[3]} "
                  f"{'causal' if case[4] else 'full'} {case[5]}: {parts} ms; sdpa {ref[0] * 1e3:.3f}+{ref[1] * 1e3:.3f} "
                  f"ms; ours/sdpa {rows[-1]['ratio']:.2f}x (fwd {rows[-1]['fwd_ratio']:.2f}x, bwd "
                  f"{rows[-1]['bwd_ratio']:.2f}x); max rel err {err:.1e}"
                  + (" WRONG" if not err < CHECK_TOL[args.dtype] else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
