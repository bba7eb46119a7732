"""The host-memory check every compile makes before anything is allocated:
params (with their gradients and two optimizer moments), consts and the
activations a step keeps (values and gradients), against the memory this
process may use. A model too large for the machine is a FlowError naming
its largest tensor, not a MemoryError inside numpy."""
from __future__ import annotations

import os
import resource

from flowgrad.errors import FlowError
from flowgrad.graph import Graph

# bytes per element kept, per byte of the tensor: params hold value, gradient
# and two moments (plus the float64 draw of the initialiser, once); a step
# keeps each activation and its gradient
PARAM_COPIES, ACTIVATION_COPIES = 4, 2


def host_budget() -> int:
    """Physical memory, or the address-space limit when one is set and lower."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        total = 1 << 62
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft not in (resource.RLIM_INFINITY, -1):
        total = min(total, soft)
    return total


def estimate(graph: Graph) -> tuple[int, object]:
    """(bytes a training step needs on the host, the node holding the most)."""
    need, largest, draw = 0, None, 0
    for node in graph.nodes:
        copies = PARAM_COPIES if node.op == "param" else 1 if node.op in ("input", "const") else ACTIVATION_COPIES
        need += node.type.nbytes * copies
        if node.op == "param":
            draw = max(draw, node.type.size * 8)
        if largest is None or node.type.nbytes > largest.type.nbytes:
            largest = node
    return need + draw, largest


def check_host_memory(graph: Graph, budget: int | None = None) -> None:
    budget = host_budget() if budget is None else budget
    need, largest = estimate(graph)
    if need <= budget:
        return
    raise FlowError(f"{graph.name} needs about {gib(need)} of host memory for a training step, more than the "
                    f"{gib(budget)} this process may use; the largest tensor is {largest.label} "
                    f"({largest.type}, {gib(largest.type.nbytes)})", largest.span,
                    hint="make the config smaller (--set)")


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
