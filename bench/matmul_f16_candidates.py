"""Time candidate builds of the f16 cooperative-matrix GEMMs (matmul_coop.glsl or
matmul_cm2.glsl under other defines, one build per operand layout) beside the
shipped kernels and torch.matmul, in one process. Two steps, since the GPU
machine has no glslc:

    python bench/matmul_f16_candidates.py build CANDIDATES.json DIR   # compile, here
    python bench/matmul_f16_candidates.py time DIR [SHAPES]            # time, on the GPU

CANDIDATES.json maps a name to {"body": "matmul_coop.glsl" | "matmul_cm2.glsl",
"BM", "BN", "BK", "NT": the tile and workgroup size, "defines": {...}}; each
is built for the nn, nt and tn layouts (matmul_coop.glsl with FIXED_A_KFAST /
FIXED_B_NFAST, matmul_cm2.glsl with A_MFAST / B_KFAST) and dispatched as the
cm2 tiles are (one pipeline per layout). SHAPES: "gpt2" (GPT-2 124M's 15
products at 8192 tokens and 4096^3), "quick" (8 of them) or M,N,K,layout;...
`time` prints each kernel's TFLOP/s and share of cuBLAS per product (every
product spot-checked against float64), the driver's register and spill
counts, and a summary: share per product, kernels as columns. DIR with no candidates.json:
the shipped kernels alone."""
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
           "matmul_cm2_64x64_k32_w64")
GPT2 = [(4096, 4096, 4096, "nn")] + [
    shape for m, n, k in ((8192, 2304, 768), (8192, 768, 768), (8192, 3072, 768), (8192, 768, 3072),
                          (8192, 50304, 768))
    for shape in ((m, n, k, "nn"), (m, k, n, "nt"), (k, n, m, "tn"))]
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
        print(f"built {name}", flush=True)
    (out / "candidates.json").write_text(json.dumps(table, indent=1))


def register(folder: Path) -> dict:
    """Make the candidates in `folder` dispatchable (as tiles with one build per layout); a
    folder without candidates.json has none (the shipped kernels alone are timed)."""
    from flowgrad.exec_vulkan import push_constants, spirv
    from flowgrad.exec_vulkan.lower import matmul_kernels as mk

    listing = folder / "candidates.json"
    table = json.loads(listing.read_text()) if listing.exists() else {}
    builds = {f"{name}_{lay}" for name in table for lay in LAYOUTS}
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
    from flowgrad.bench.matmul import parse_shape
    return [parse_shape(s) for s in text.split(";")]


def time_all(folder: Path, shapes: list) -> None:
    os.environ.setdefault("FLOWGRAD_VK_PIPELINE_STATS", "1")
    from flowgrad.bench import matmul as mb
    from flowgrad.exec_vulkan import select_device

    mb.FLOP_PER_SUBMIT = 2e10
    table = register(folder)
    names = [*SHIPPED, *table]
    device = select_device("vulkan")
    info = device.info
    print(f"device: {info.name}, shared memory {info.shared_memory}, cm2 {info.cm2_invocations} "
          f"{info.cm2_granularity}", flush=True)
    for name in names[1:]:
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
        for name in names:
            try:
                (row,) = mb.time_shape(device, "f16", shape, [(None if name == "auto" else name, None)])
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


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "build":
        build(Path(argv[1]), Path(argv[2]))
    elif argv[:1] == ["time"] and len(argv) in (2, 3):
        time_all(Path(argv[1]), parse_shapes(argv[2] if len(argv) == 3 else "quick"))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
