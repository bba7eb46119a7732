"""Device limits every lowering and planner pass must respect, in one place.

The group-count and alignment figures are the minimums every Vulkan device
guarantees, so a plan made without a device (explain, the dry run) holds on
any device."""
from __future__ import annotations

MAX_GROUPS = 65535           # workgroups per grid axis
DRY_MAX_GROUPS = (MAX_GROUPS, MAX_GROUPS, MAX_GROUPS)
ALIGN = 256                  # buffer packing: >= any device's minStorageBufferOffsetAlignment
PUSH_LIMIT = 128             # push-constant bytes every device offers


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def grid(n: int, local: int = 256) -> tuple[int, int, int]:
    """Group counts for a 1-D launch over n items with `local` invocations
    per group; spills into y past MAX_GROUPS groups (the shader computes its
    flat index as common.glsl's flat_index() and checks it against n)."""
    groups = max(1, -(-int(n) // local))
    x = min(groups, MAX_GROUPS)
    return x, -(-groups // x), 1


def groups_1d(n: int, local: int = 256, cap: int = MAX_GROUPS) -> tuple[int, int, int]:
    """Group count for a grid-stride loop over n items (the shader loops over
    what the capped grid does not cover)."""
    return (max(1, min(-(-int(n) // local), cap)), 1, 1)
