"""Time candidate builds of the f32 GEMM (matmul_tiled.glsl under other
defines) beside the shipped tiles and torch.matmul, in one process. Two
steps, since the GPU machine may have no glslc:

    python bench/matmul_candidates.py build CANDIDATES.json DIR   # compile, here
    python bench/matmul_candidates.py time DIR [--small | --gpt2]  # time, on the GPU

CANDIDATES.json maps a name to the defines of one build, e.g.
{"c_128x256_k8": {"BM": 128, "BN": 256, "BK": 8, "TM": 8, "TN": 16}}: the tile
(BM x BN outputs, BK deep, TM x TN per invocation, PAD), plus any define an
experimental edit of the shader reads; "FIXED_LAYOUT": 1 specializes each
dispatch's pipeline to its product's operand layout, as the shipped
128x128_k8 is. `time` prints each product's share of cuBLAS per kernel, the driver's register counts where it reports them,
and per kernel the share at 4096^3 and the mean and min over gpt_small's
13 products; every product is spot-checked against float64 (bench/MATMUL_NOTES.md
says how its tables were made). --small: three odd-sized products, checked only; --gpt2:
GPT-2 124M's products at 8192 tokens instead of gpt_small's (the mean and min over those)."""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SHIPPED = ("matmul_128x128_k16", "matmul_128x128_k8")
SMALL = [(67, 45, 93, "nn"), (256, 272, 144, "nt"), (130, 260, 70, "tn")]
# GPT-2 124M at 8192 tokens: the 8192x768 outputs (the projection's and the MLP's forward, the
# input gradients), the wide forwards, the weight gradients
GPT2 = [(8192, 768, 768, "nn"), (8192, 768, 3072, "nn"), (8192, 768, 768, "nt"), (8192, 768, 2304, "nt"),
        (8192, 768, 3072, "nt"), (8192, 2304, 768, "nn"), (8192, 3072, 768, "nn"), (8192, 3072, 768, "nt"),
        (768, 2304, 8192, "tn"), (768, 768, 8192, "tn"), (768, 3072, 8192, "tn"), (3072, 768, 8192, "tn")]


def shader_name(name: str) -> str:
    """A candidate's shader name: the bench reports GEMM dispatches by their matmul_ prefix."""
    return name if name.startswith("matmul_") else f"matmul_{name}"


def build(candidates: Path, out: Path) -> None:
    import build_shaders

    table = {shader_name(k): v for k, v in json.loads(candidates.read_text()).items()}
    out.mkdir(parents=True, exist_ok=True)
    source = out / "candidate.comp"
    source.write_text('#version 450\n#include "matmul_tiled.glsl"\n')
    for name, defines in table.items():
        build_shaders.compile_one(source, [f"-D{k}={v}" for k, v in defines.items()], out / f"{name}.spv")
        print(f"built {out / name}.spv", flush=True)
    (out / "candidates.json").write_text(json.dumps(table, indent=1))


def register(folder: Path) -> dict:
    """Make the candidates in `folder` dispatchable tiles; returns their table."""
    from flowgrad.exec_vulkan import push_constants, spirv
    from flowgrad.exec_vulkan.lower import matmul_kernels as mk

    table = json.loads((folder / "candidates.json").read_text())
    shipped = spirv.spv_path
    spirv.spv_path = lambda shader, variant=None: (folder / f"{shader}.spv" if shader in table
                                                   else shipped(shader, variant))
    for name, d in table.items():
        mk.TILES[name] = mk.Tile(name, d["BM"], d["BN"], d["BK"], fixed_layout=bool(d.get("FIXED_LAYOUT")))
        push_constants.SPECS[name] = push_constants.SPECS[SHIPPED[0]]
    return table


def time_all(folder: Path, small: bool, gpt2: bool = False) -> None:
    os.environ.setdefault("FLOWGRAD_VK_PIPELINE_STATS", "1")
    from flowgrad.bench import matmul as mb
    from flowgrad.exec_vulkan import select_device

    names = [*SHIPPED, *register(folder)]
    try:
        import torch
        torch.backends.cuda.matmul.allow_tf32 = False   # cuBLAS in true f32, as our kernels
    except ImportError:
        pass
    device = select_device("vulkan")
    print(f"device: {device.info.name}", flush=True)
    for name in names:
        try:
            stats = device.pipeline_statistics(name)
            print(name, {k: v for k, v in stats.items() if "Register" in k or "Memory" in k}, flush=True)
        except Exception as e:  # noqa: BLE001 - statistics are optional
            print(f"{name}: no statistics ({type(e).__name__})", flush=True)
    shapes = SMALL if small else mb.SQUARE + (GPT2 if gpt2 else mb.GPT_SMALL)
    shares = {name: [] for name in names}
    for shape in shapes:
        rows = mb.run(device, "f32", [shape], [(name, None) for name in names], torch=not small)
        print(mb.report(rows, device.info.name, "f32").split("\n", 2)[-1], flush=True)
        for r in rows:
            shares[r["asked"]].append(r["tflops"] / r["torch"] if r["torch"] else float("nan"))
    if small:
        return
    print(f"\nshare of cuBLAS: 4096^3, {'GPT-2' if gpt2 else 'gpt_small'} mean, min")
    for name, s in shares.items():
        print(f"{name:<28}{s[0]:6.2f}{statistics.mean(s[1:]):6.2f}{min(s[1:]):6.2f}")


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "build":
        build(Path(argv[1]), Path(argv[2]))
    elif argv[:1] == ["time"] and len(argv) in (2, 3):
        time_all(Path(argv[1]), "--small" in argv, "--gpt2" in argv)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
