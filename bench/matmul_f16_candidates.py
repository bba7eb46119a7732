"""Time candidate builds of the f16 cooperative-matrix GEMMs (matmul_coop.glsl or
matmul_cm2.glsl under other defines, one build per operand layout) beside the
shipped kernels and torch.matmul, in one process. Two steps, since the GPU
machine has no glslc:

    python bench/matmul_f16_candidates.py build CANDIDATES.json DIR   # compile, here
    python bench/matmul_f16_candidates.py time DIR [SHAPES [KERNELS]]  # time, on the GPU
    python bench/matmul_f16_candidates.py gelu [M,N,K]                  # the store's activation

CANDIDATES.json maps a name to {"body": "matmul_coop.glsl" | "matmul_cm2.glsl",
"BM", "BN", "BK", "NT": the tile and workgroup size, "defines": {...}}; each
is built for the nn, nt and tn layouts (matmul_coop.glsl with FIXED_A_KFAST /
FIXED_B_NFAST, matmul_cm2.glsl with A_MFAST / B_KFAST) and dispatched as the
cm2 tiles are (one pipeline per layout). SHAPES: "gpt2" (GPT-2 124M's 15
products at 8192 tokens and 4096^3), "quick" (8 of them), "waves" (the
products with 768-wide outputs and the 8192-deep weight gradients, whose
grids are few waves of workgroups), "tn" (those weight gradients) or
M,N,K,layout;... KERNELS: comma-separated names ("auto": what the lowering
picks; a shipped tile; a candidate; "cands": every candidate), each with
"@C" to force C split-K chunks, "@sk" stream-K (matmul_coop_khr_w128 has it; "@skG" on G
workgroups); default: the shipped ones and every candidate.
`time` prints each kernel's TFLOP/s and share of cuBLAS per product (every
product spot-checked against float64), the driver's register and spill
counts, and a summary: share per product, kernels as columns. DIR with no candidates.json:
the shipped kernels alone.

`gelu` times GPT-2's MLP-up product with bias (8192x3072 by 768) on the kernel
the lowering picks two ways: gelu in the GEMM's store (h stored beside it), and
the product with its bias into h followed by gelu as a fused_map pass (what
ACTIVATION_IN_STORE["nvidia"] = False records); both checked against float64."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

LAYOUTS = ("nn", "nt", "tn")
# timed beside the candidates: what the lowering picks, and the shipped f16 tiles it picks among on NVIDIA
SHIPPED = ("auto", "matmul_cm2_128x256_k32_w256_u2", "matmul_coop_khr_w128", "matmul_cm2_128x64_k64_w128",
           "matmul_cm2_128x96_k64_w128_u2", "matmul_cm2_64x64_k32_w64")
GPT2 = [(4096, 4096, 4096, "nn")] + [
    shape for m, n, k in ((8192, 2304, 768), (8192, 768, 768), (8192, 3072, 768), (8192, 768, 3072),
                          (8192, 50304, 768))
    for shape in ((m, n, k, "nn"), (m, k, n, "nt"), (k, n, m, "tn"))]
WAVES = [(8192, 768, 768, "nn"), (8192, 768, 3072, "nn"), (8192, 768, 768, "nt"), (8192, 768, 2304, "nt"),
         (8192, 768, 3072, "nt"), (8192, 2304, 768, "nn")]
TN = [(768, 768, 8192, "tn"), (768, 2304, 8192, "tn"), (768, 3072, 8192, "tn"), (3072, 768, 8192, "tn")]
QUICK = [(4096, 4096, 4096, "nn"), (8192, 2304, 768, "nn"), (8192, 768, 3072, "nn"), (8192, 768, 3072, "nt"),
         (8192, 3072, 768, "nt"), (768, 3072, 8192, "tn"), (3072, 768, 8192, "tn"), (8192, 50304, 768, "nn")]


def layout_defines(body: str, layout: str) -> dict:
    if body == "matmul_cm2.glsl":
        return {"A_MFAST": int(layout[0] == "t"), "B_KFAST": int(layout[1] == "t")}
    return {"FIXED_A_KFAST": int(layout[0] == "n"), "FIXED_B_NFAST": int(layout[1] == "n")}


def build(candidates: Path, out: Path) -> None:
    import build_shaders

    table = json.loads(candidates.read_text())
    out.mkdir(parents=True, exist_ok=True)
    coop = out / "coop_candidate.comp"
    coop.write_text('// compiler: glslc-2025\n#version 450\n#include "matmul_coop.glsl"\n')
    for name, c in table.items():
        body = c["body"]
        source = coop if body == "matmul_coop.glsl" else build_shaders.SHADER_DIR / body
        base = {"BM": c["BM"], "BN": c["BN"], "BK": c["BK"], "NT": c["NT"]} if body == "matmul_cm2.glsl" else {}
        for layout in LAYOUTS:
            defines = {**base, **c.get("defines", {}), **layout_defines(body, layout)}
            build_shaders.compile_one(source, [f"-D{k}={v}" for k, v in defines.items()], out / f"{name}_{layout}.spv")
            # split-K's f32 partials (a forced count, "@C", dispatches this build)
            build_shaders.compile_one(source, [f"-D{k}={v}" for k, v in {**defines, "PARTS_F32": 1}.items()],
                                      out / f"{name}_{layout}_p32.spv")
        print(f"built {name}", flush=True)
    (out / "candidates.json").write_text(json.dumps(table, indent=1))


def register(folder: Path) -> dict:
    """Make the candidates in `folder` dispatchable (as tiles with one build per layout); a
    folder without candidates.json has none (the shipped kernels alone are timed)."""
    from flowgrad.exec_vulkan import push_constants, spirv
    from flowgrad.exec_vulkan.lower import matmul_kernels as mk

    listing = folder / "candidates.json"
    table = json.loads(listing.read_text()) if listing.exists() else {}
    builds = {f"{name}_{lay}{p}" for name in table for lay in LAYOUTS for p in ("", "_p32")}
    shipped = spirv.spv_path
    spirv.spv_path = lambda shader, variant=None: (folder / f"{shader}.spv" if shader in builds
                                                   else shipped(shader, variant))
    for name, c in table.items():
        mk.CM2S[name] = mk.Tile(name, c["BM"], c["BN"], c["BK"], coop=True, cm2=True, invocations=c["NT"],
                                layouts=True)
    for b in builds:
        push_constants.SPECS[b] = push_constants.SPECS["matmul_coop"]
    return table


def parse_shapes(text: str) -> list:
    if text == "gpt2":
        return GPT2
    if text == "quick":
        return QUICK
    if text == "waves":
        return WAVES
    if text == "tn":
        return TN
    from flowgrad.bench.matmul import parse_shape
    return [parse_shape(s) for s in text.split(";")]


def parse_kernels(text: str | None, table: dict) -> list[tuple[str, int | None, int | None]]:
    """(kernel name, forced split-K chunks or None, stream-K workgroups or None) per KERNELS
    entry: name, name@C (C chunks), name@sk (stream-K, the workgroups stream_groups gives) or
    name@skG (G workgroups)."""
    if not text:
        return [(name, None, None) for name in (*SHIPPED, *table)]
    out = []
    for entry in text.split(","):
        name, _, forced = entry.partition("@")
        stream = int(forced[2:] or 0) if forced.startswith("sk") else None
        chunks = int(forced) if forced and stream is None else None
        out.extend((nm, chunks, stream) for nm in (table if name == "cands" else [name]))
    return out


def time_all(folder: Path, shapes: list, kernels: str | None = None) -> None:
    os.environ.setdefault("FLOWGRAD_VK_PIPELINE_STATS", "1")
    from flowgrad.bench import matmul as mb
    from flowgrad.exec_vulkan import select_device

    mb.FLOP_PER_SUBMIT = 2e10
    table = register(folder)
    runs = parse_kernels(kernels, table)
    names = [nm + (f"@{c}" if c else "") + ("" if st is None else f"@sk{st or ''}") for nm, c, st in runs]
    device = select_device("vulkan")
    info = device.info
    print(f"device: {info.name}, shared memory {info.shared_memory}, cm2 {info.cm2_invocations} "
          f"{info.cm2_granularity}", flush=True)
    for name in dict.fromkeys(nm for nm, *_ in runs if nm != "auto"):
        for lay in (LAYOUTS if name in table or "cm2" in name or "khr" in name else ("",)):
            shader = f"{name}_{lay}" if lay else name
            try:
                stats = device.pipeline_statistics(shader)
                print("pipeline", shader, {k: v for k, v in stats.items()
                                           if "Register" in k or "Memory" in k or "Shared" in k}, flush=True)
            except Exception as e:  # noqa: BLE001 - a candidate the driver rejects is reported, not fatal
                print(f"pipeline {shader}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    share = {}
    for shape in shapes:
        ref = mb.torch_tflops("f16", shape)
        for name, (nm, chunks, stream) in zip(names, runs):
            try:
                (row,) = mb.time_shape(device, "f16", shape, [(None if nm == "auto" else nm, chunks, stream)])
            except Exception as e:  # noqa: BLE001
                print(f"{shape} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            row["torch"] = ref
            wrong = "" if row["err"] < mb.CHECK_TOL["f16"] else " WRONG"
            share[shape, name] = row["tflops"] / ref if ref else float("nan")
            print(f"{shape} {name:<34}{row['kernel']:<44}{row['tflops']:8.1f}{ref or 0:8.1f}"
                  f"{share[shape, name]:6.2f} err {row['err']:.1e}{wrong}", flush=True)
    print("\nshare of cuBLAS f16 (kernels as columns: " + ", ".join(f"{i}={n}" for i, n in enumerate(names)) + ")")
    for shape in shapes:
        m, n, k, lay = shape
        cells = "".join(f"{share[shape, nm]:6.2f}" if (shape, nm) in share else "     -" for nm in names)
        print(f"{f'{m},{n},{k} {lay}':<22}{cells}")


def _gelu64(x):
    from math import erf, sqrt

    import numpy as np

    return x * 0.5 * (1.0 + np.vectorize(erf)(x / sqrt(2.0)))


def time_gelu(m: int, n: int, k: int) -> None:
    """gelu(x @ w + bias) at m x n by k: the store's activation against a pass of its own."""
    import statistics

    import numpy as np

    from flowgrad.exec_vulkan import select_device
    from flowgrad.exec_vulkan.encoder import timed_submits
    from flowgrad.exec_vulkan.lower.fused import (
        forward_program,
        pointwise_of,
        run_program,
    )
    from flowgrad.exec_vulkan.lower.linalg import Epilogue, Operand, gemm
    from flowgrad.exec_vulkan.oneshot import OneShot

    device = select_device("vulkan")
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (m, k)).astype(np.float16)
    w = (rng.uniform(-1, 1, (k, n)) / np.sqrt(k)).astype(np.float16)
    bias = rng.uniform(-1, 1, (n,)).astype(np.float16)
    gelu = {"approximate": "none"}
    gelu_op = int(pointwise_of("gelu", gelu).op)
    reps = max(4, min(200, int(2e10 / (2.0 * m * n * k))))

    def record(rec, xv, wv, bv, hv, ov, mode):
        a, b = Operand(xv, k, 1, ()), Operand(wv, n, 1, ())
        if mode == "store":
            epi = Epilogue(bias=bv, act=gelu_op, pre=hv)
            gemm(rec, a, b, Operand(ov, n, 1, ()), m, n, k, (), (), epilogue=epi)
        else:
            epi = Epilogue(bias=bv)
            gemm(rec, a, b, Operand(hv, n, 1, ()), m, n, k, (), (), epilogue=epi)
            if mode == "apart":
                run_program(rec, forward_program((("gelu", (0,), gelu),), 1), {("x", 0): hv}, [ov], (m, n))
        assert epi.applied, mode

    rows = rng.integers(0, m, 64)
    want_h = x[rows].astype(np.float64) @ w.astype(np.float64) + bias.astype(np.float64)
    want = _gelu64(want_h)
    modes = ("apart", "store", "bias only")
    with OneShot(device) as data:   # operands and outputs live across the runs below
        xv, wv, bv = data.upload(x), data.upload(w), data.upload(bias)
        hv, ov = data.empty((m, n), "f16"), data.empty((m, n), "f16")
        data.run()
        # every timing first, twice over in turn, the checks (downloads) after
        for mode in modes + modes:
            with OneShot(device) as s:
                for _ in range(reps):
                    record(s.rec, xv, wv, bv, hv, ov, mode)
                used = sorted({c.shader for c in s.rec.commands if getattr(c, "shader", "")})
                s.rec.arena.materialize(device, device.pool)
                times = timed_submits(device, s.rec.commands, 8, "timing gelu")
            sec = statistics.median(times[1:]) / reps
            print(f"gelu {m},{n},{k} {mode:<10} {'+'.join(used):<60} {sec * 1e6:8.1f} us "
                  f"{2.0 * m * n * k / sec / 1e12:7.1f} TFLOP/s", flush=True)
        for mode in modes:
            with OneShot(device) as s:
                record(s.rec, xv, wv, bv, hv, ov, mode)
                s.download(hv)
                s.download(ov)
                h, out = s.run()
            err = float(np.max(np.abs(h[rows].astype(np.float64) - want_h)))
            if mode != "bias only":
                err = max(err, float(np.max(np.abs(out[rows].astype(np.float64) - want))))
            print(f"gelu {m},{n},{k} {mode:<10} max err {err:.1e}", flush=True)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "build":
        build(Path(argv[1]), Path(argv[2]))
    elif argv[:1] == ["time"] and len(argv) in (2, 3, 4):
        time_all(Path(argv[1]), parse_shapes(argv[2] if len(argv) >= 3 else "quick"),
                 argv[3] if len(argv) == 4 else None)
    elif argv[:1] == ["gelu"] and len(argv) in (1, 2):
        time_gelu(*(int(x) for x in (argv[1] if len(argv) == 2 else "8192,3072,768").split(",")))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
