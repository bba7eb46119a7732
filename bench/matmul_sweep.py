"""Time every GEMM tile (and split-K depth, and the cooperative-matrix kernels
in f16) at 4096^3 and gpt_small's shapes, beside torch.matmul on the same GPU;
the measured table in flowgrad/exec_vulkan/lower/matmul_kernels.py comes from
this. Full rows go to $OUT/matmul_sweep.json (or ./matmul_sweep.json).

    python bench/matmul_sweep.py [--quick] [--confirm] [--f16-only]

--confirm times only the kernels the table picks (f32) and the
cooperative-matrix variants (f16), beside torch; --f16-only skips the f32
tiles. In f16 each matmul_cm2 tile runs as the table splits K and unsplit (x1)."""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from flowgrad.exec_vulkan import select_device
from flowgrad.bench import matmul as mb
from flowgrad.exec_vulkan.lower import matmul_kernels as mk


def best(rows):
    return max(rows, key=lambda r: r["tflops"])


def main() -> int:
    quick = "--quick" in sys.argv
    confirm = "--confirm" in sys.argv
    try:
        import torch
        torch.backends.cuda.matmul.allow_tf32 = False   # cuBLAS in true f32, as our kernels
    except ImportError:
        pass
    device = select_device("vulkan")
    print(f"device: {device.info}  coopmat={device.info.coopmat}  coopmat_f16={device.info.coopmat_f16}  "
          f"cm2 invocations={device.info.cm2_invocations} granularity={device.info.cm2_granularity}", flush=True)
    if device.info.coopmat and not device.info.coopmat_f16:
        from flowgrad.exec_vulkan import discovery, instance
        try:
            print("coopmat query:", discovery.coopmat_f16_sizes(instance.load_vulkan(), device.physical, "NV"))
        except Exception:  # noqa: BLE001 - diagnosis only
            traceback.print_exc()
    out = {"device": device.info.name, "f32": [], "splitk": [], "f16": []}
    shapes = [] if "--f16-only" in sys.argv else mb.SQUARE + (mb.GPT_SMALL[:2] if quick else mb.GPT_SMALL)
    summary = []
    for shape in shapes:
        tiles = [] if confirm else [(s, None) for s in sorted(mk.TILES)]
        rows = mb.run(device, "f32", [shape], tiles + [(None, None)])
        out["f32"] += rows
        b = best(rows[:-1] or rows)
        auto = rows[-1]
        summary.append(("f32", shape, b, auto))
        print(mb.report(rows, device.info.name, "f32").split("\n", 2)[-1], flush=True)
    for shape in [s for s in shapes if s[3] == "tn" and not confirm]:
        tile = best([r for r in out["f32"] if r["shape"] == shape])["kernel"].split("+")[0]
        for t in sorted({tile, "matmul_64x64_k16", "matmul_128x128_k8"}):
            rows = mb.run(device, "f32", [shape], [(t, c) for c in (1, 2, 4, 8, 16)])
            out["splitk"] += rows
            print(mb.report(rows, device.info.name, "f32").split("\n", 2)[-1], flush=True)
    f16_shapes = mb.SQUARE + mb.GPT_SMALL
    cm2s = [t.shader for t in mk.cm2_builds(device.info)]
    # the f16-storage tile (~30 TFLOP/s on the H200) only where no cooperative-matrix kernel runs
    kernels = [(None, None)] if cm2s else [(mk.F16_TILE, None), (None, None)]
    if device.info.coopmat_f16:
        kernels = [(s, None) for s in sorted(mk.COOPS)] + kernels
    kernels = [(s, None) for s in cm2s] + [(s, 1) for s in cm2s if not confirm] + kernels

    if quick:   # 4096^3 and one product of each layout
        f16_shapes = mb.SQUARE + [(4096, 1536, 512, "nn"), (4096, 512, 512, "nn"), (4096, 512, 1536, "nt"),
                                  (512, 1536, 4096, "tn")]
    for shape in f16_shapes:
        try:
            rows = mb.run(device, "f16", [shape], kernels)
        except Exception:  # noqa: BLE001 - report and keep the f32 results
            traceback.print_exc()
            break
        out["f16"] += rows
        summary.append(("f16", shape, best(rows), rows[-1]))
        print(mb.report(rows, device.info.name, "f16").split("\n", 2)[-1], flush=True)
    path = Path(os.environ.get("OUT", ".")) / "matmul_sweep.json"
    path.write_text(json.dumps(out, indent=1, default=str))
    print("\nSUMMARY (best kernel and the auto-selected one vs torch.matmul; TFLOP/s, ratio)")
    for dtype, shape, b, auto in summary:
        t = b["torch"] or float("nan")
        print(f"{dtype} {shape}: best {b['asked']:<20} {b['tflops']:7.2f} ({b['tflops'] / t:.2f})  "
              f"auto {auto['kernel']:<28} {auto['tflops']:7.2f} ({auto['tflops'] / t:.2f})  torch {t:7.2f}"
              f"  err {max(b['err'], auto['err']):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
