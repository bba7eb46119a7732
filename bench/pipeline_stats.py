#!/usr/bin/env python3
"""The driver's statistics (registers, spills, shared memory) of the GEMM and
attention pipelines, through VK_KHR_pipeline_executable_properties:

    FLOWGRAD_VK_PIPELINE_STATS=1 python bench/pipeline_stats.py [SHADER[.VARIANT] ...]

A register count over 128 per invocation halves how many warps an NVIDIA SM
holds; spilled bytes are local-memory traffic in the inner loop."""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def default_shaders() -> list[tuple[str, str | None]]:
    from flowgrad.exec_vulkan.lower import attention, matmul_kernels as mk

    out = [(s, None) for s in sorted(mk.TILES)] + [(mk.F16_TILE, "f16")]
    # one layout per tile built for each
    out += [(tiles[s].shader_for(False, False), None) for tiles in (mk.COOPS, mk.CM2S) for s in sorted(tiles)]
    return out + [(stem, None) for stem in sorted(attention.shader_builds())]


def main(argv=None) -> int:
    os.environ.setdefault("FLOWGRAD_VK_PIPELINE_STATS", "1")
    from flowgrad.exec_vulkan import select_device

    names = argv if argv is not None else sys.argv[1:]
    shaders = [tuple(n.split(".", 1)) if "." in n else (n, None) for n in names] or default_shaders()
    device = select_device("vulkan")
    print(f"pipeline statistics on {device.info.name}")
    for shader, variant in shaders:
        try:
            stats = device.pipeline_statistics(shader, variant)
        except Exception as e:  # noqa: BLE001 - report and go on to the next shader
            print(f"{shader}{'.' + variant if variant else ''}: {type(e).__name__}: {e}")
            continue
        text = ", ".join(f"{k} {v}" for k, v in stats.items())
        print(f"{shader}{'.' + variant if variant else ''}: {text}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
