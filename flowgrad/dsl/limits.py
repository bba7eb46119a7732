"""The language's size limits. Each keeps a small file from asking for an
unbounded amount of work (a hang) or memory (a crash) and turns the attempt
into a positioned FlowError; docs/language.md lists them."""
from __future__ import annotations

import contextlib
import math
import sys

MAX_DEPTH = 100              # nesting of expressions (a + b + c nests twice), on the parse tree
MAX_NUMBER_DIGITS = 100      # characters in a number literal or an int --set value
MAX_INT = 2**63 - 1          # magnitude of any compile-time int
MAX_REPEAT = 10_000          # repeat(n, ...)
MAX_BLOCK_DEPTH = 32         # blocks calling blocks, innermost call counted
MAX_NODES = 50_000           # graph nodes after blocks and repeats are expanded
MAX_RANK = 8                 # axes of a tensor
MAX_ELEMENTS = 2**31 - 1     # elements of one tensor (device kernels index with 32 bits)
MAX_STRING = 4096            # characters in a string literal or a --set value

# Python frames building a model may stack: the builder recurses once per
# expression level (up to 6 frames for a call), inside each of up to
# MAX_BLOCK_DEPTH nested block instances, so a file within the limits above
# can nest far past Python's default recursion limit of 1,000.
BUILD_FRAMES = (MAX_BLOCK_DEPTH + 1) * (MAX_DEPTH * 6 + 50)


@contextlib.contextmanager
def recursion_room(frames: int):
    """Let the code inside recurse `frames` deeper than the caller stands.
    From Python 3.11 a Python-to-Python call takes no C stack, so this
    costs heap memory only. The limit goes back unless something else
    changed it meanwhile (another thread's build)."""
    old = sys.getrecursionlimit()
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    new = max(old, depth + frames)
    sys.setrecursionlimit(new)
    try:
        yield
    finally:
        if sys.getrecursionlimit() == new:
            sys.setrecursionlimit(old)


def type_problem(shape: tuple[int, ...]) -> str | None:
    """Why a tensor shape is over the limits, or None."""
    if len(shape) > MAX_RANK:
        return f"a tensor has at most {MAX_RANK} axes, this one has {len(shape)}"
    size = math.prod(shape)
    if size > MAX_ELEMENTS:
        return f"a tensor has at most {MAX_ELEMENTS:,} elements, this one has {size:,}"
    return None


def int_problem(value: int) -> str | None:
    if abs(value) > MAX_INT:
        return (f"the integer {describe_int(value)} is past ±{MAX_INT:,}, the largest magnitude a model may "
                "use")
    return None


def describe_int(value: int) -> str:
    """An int for a message: in full when short, else its digit count (Python
    refuses str() of an int past 4300 digits)."""
    digits = math.floor(abs(value).bit_length() * math.log10(2)) + 1 if value else 1
    return str(value) if digits <= 30 else f"with about {digits} digits"
