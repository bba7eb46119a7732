#!/usr/bin/env python3
"""The kernels that move 16-byte vectors (layernorm's norm_vec: lower/norm.py's VECTOR_ROWS;
contiguous pointwise chains' fused_map_vec: lower/fused.py's VECTOR_MAPS; mixed precision's
batched casts, cast_f16_multi_vec: multi_tensor.py's VECTOR_CASTS; Adam's f32 update,
adam_multi_vec: optim_records.py's VECTOR_ADAM) against the scalar ones,
each added to the last, in one process: a model's graph-path Adam step compiled with each setting in turn, two
rounds, median step time and the step's GPU time by kernel family (flowgrad.bench.families).

    python bench/vector_kernels.py [--set k=v ...] [--dtype mixed] [--steps 15]

Default: tiny_gpt at GPT-2 124M's shape (batch 8, seq 1024). A benchmark: nothing asserts its
numbers; the losses are printed so that a difference shows."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ab_step import timed_step  # noqa: E402
from flowgrad.bench.gpt2 import GPT2  # noqa: E402
from flowgrad.dsl.config import parse_sets  # noqa: E402
from flowgrad.exec_vulkan import multi_tensor, optim_records  # noqa: E402
from flowgrad.exec_vulkan.lower import fused, norm  # noqa: E402

SETTINGS = {"scalar": (False,) * 4, "rows": (True, False, False, False), "rows, maps": (True, True, False, False),
            "rows, maps, casts": (True, True, True, False), "rows, maps, casts, adam": (True,) * 4}


def run(config: dict, dtype: str, steps: int, flags) -> dict:
    norm.VECTOR_ROWS, fused.VECTOR_MAPS, multi_tensor.VECTOR_CASTS, optim_records.VECTOR_ADAM = flags
    return timed_step(config, dtype, steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE")
    ap.add_argument("--dtype", default="mixed")
    ap.add_argument("--steps", type=int, default=15)
    a = ap.parse_args(argv)
    config = {**GPT2, **parse_sets(a.set)}
    for rnd in (1, 2):
        for name, flags in SETTINGS.items():
            r = run(config, a.dtype, a.steps, flags)
            print(f"[{name} {rnd}] step {r['step_ms']:.3f} ms, losses {r['losses']}, {r['families']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
