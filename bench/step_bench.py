#!/usr/bin/env python3
"""Graph path vs closures, one training step of a small decoder (tiny_gpt:
d=64, seq=64, 4 heads, 2 blocks) on one Vulkan device.

    python bench/step_bench.py [--device vulkan:0] [--repeats 20] [--set batch=8] [--json]

Same as `flowgrad bench`. Prints median step times, the closures/graph ratio,
and submits, dispatches and host transfers per step for each path."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flowgrad.dsl.config import parse_sets  # noqa: E402
from flowgrad.errors import FlowError  # noqa: E402
from flowgrad.bench import step as bench  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=bench.MODEL, help="a .flow file or a shipped model's name")
    p.add_argument("--device", default="vulkan")
    p.add_argument("--dtype", default="f32", choices=["f32", "f16"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        r = bench.run(args.model, args.device, args.repeats, parse_sets(args.set), args.dtype)
    except FlowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(r, indent=2) if args.json else bench.report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
