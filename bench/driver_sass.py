#!/usr/bin/env python3
"""The machine code NVIDIA's Vulkan driver compiled, from its shader disk cache: every pipeline
a command builds, disassembled, with a count of each opcode (HMMA, LDSM, LDL for spills, ...).

    python bench/driver_sass.py OUT -- python bench/attention_tiles.py --builds cm2 --case 8,1024,12,1

runs the command with the driver's disk cache in a fresh folder, then writes OUT/sass.txt (each
pipeline's disassembly, its opcode counts first) and prints the counts. Needs Python's
`zstandard` (pip install zstandard) and `nvdisasm` (CUDA's bin/ or triton's package). The cache
format is the driver's own, found by inspection on driver 580.159 (bench/MATMUL_NOTES.md,
"Reading the SASS"): a .bin of zstd frames, a pipeline's frame starting "NVDANVVM", then a table
whose entries hold the offset of a header 0x18 bytes before the code. A benchmark tool: nothing
asserts what it prints."""
from __future__ import annotations

import collections
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

MAGIC = b"\x28\xb5\x2f\xfd"   # a zstd frame
HEADER = 0x18                 # from a pipeline's header to its code
OPCODE = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def nvdisasm() -> str:
    found = glob.glob("/usr/local/cuda*/bin/nvdisasm")
    try:
        import triton
        found += glob.glob(os.path.dirname(triton.__file__) + "/**/nvdisasm", recursive=True)
    except ImportError:
        pass
    if not found:
        sys.exit("no nvdisasm: install CUDA's toolkit or triton")
    return found[0]


def pipelines(cache: Path):
    """The decompressed pipeline entries of every .bin under the cache folder."""
    import zstandard

    for path in sorted(cache.rglob("*.bin")):
        data = path.read_bytes()
        at = data.find(MAGIC)
        while at >= 0:
            try:
                blob = zstandard.ZstdDecompressor().decompressobj().decompress(data[at:])
            except zstandard.ZstdError:
                blob = b""
            if blob.startswith(b"NVDANVVM"):
                yield blob
            at = data.find(MAGIC, at + 4)


def disassemble(tool: str, blob: bytes, scratch: Path) -> str | None:
    """The longest prefix of the code that nvdisasm reads (it stops at data past the code)."""
    def run(start: int, size: int):
        scratch.write_bytes(blob[start:start + size])
        r = subprocess.run([tool, "-b", "SM90", str(scratch)], capture_output=True, text=True)
        return r.returncode == 0, r.stdout

    for i in range(12, 80, 4):   # the table's entries: the first that points at code
        start = int.from_bytes(blob[i:i + 4], "little") + HEADER
        if not 0x40 <= start - HEADER <= 0x4000:
            continue
        ok, text = run(start, 4096)
        if not ok or text.count("/*") < 50:
            continue
        lo, hi = 4096, len(blob) - start
        while hi - lo > 16:
            mid = (lo + hi) // 32 * 16
            lo, hi = (mid, hi) if run(start, mid)[0] else (lo, mid)
        return run(start, lo)[1]
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv.index("--") != 1:
        sys.exit(__doc__)
    out, command = Path(argv[0]), argv[2:]
    tool = nvdisasm()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        env = {**os.environ, "__GL_SHADER_DISK_CACHE": "1", "__GL_SHADER_DISK_CACHE_PATH": str(cache),
               "__GL_SHADER_DISK_CACHE_SKIP_CLEANUP": "1"}
        subprocess.run(command, env=env, check=True)
        sections = []
        for n, blob in enumerate(pipelines(cache), 1):
            text = disassemble(tool, blob, Path(tmp) / "code.bin")
            if text is None:
                print(f"pipeline {n}: {len(blob)} bytes, not disassembled")
                continue
            counts = collections.Counter(m.group(1) for m in OPCODE.finditer(text))
            top = " ".join(f"{op}:{c}" for op, c in counts.most_common(30))
            print(f"pipeline {n}: {sum(counts.values())} instructions | {top}", flush=True)
            sections.append(f"# pipeline {n}\n# {top}\n{text}")
    (out / "sass.txt").write_text("\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
