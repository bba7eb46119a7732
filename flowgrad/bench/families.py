"""`flowgrad bench gpt2 --families`: one mixed-precision training step's GPU
time grouped by what its kernels do (products, attention, elementwise, ...),
flowgrad's beside PyTorch's, so a gap in the step time points at the
family it comes from.

flowgrad's: the graph path's profile (GraphSession.profile, as
`explain --analyze` takes it): one section per node and direction, timed by
GPU timestamps where the device has them; each section's family is that of
its node's op (OP_FAMILIES), a fused chain's that of its first step, so a
product with its epilogue counts as a product. PyTorch's: torch.profiler's
CUDA kernels of the same step, each kernel's family the first of
KERNEL_FAMILIES whose word its name holds. A torch.compile'd kernel (Triton)
fuses several ops under one name: it counts in the family of the first
word its name holds, an approximation.

Either side: each family's time is its median over the profiled steps."""
from __future__ import annotations

import statistics

FAMILIES = ("products", "attention", "elementwise", "layernorm", "cross_entropy", "embedding", "casts",
            "optimizer", "transfers", "other")
PROFILED_STEPS = 5

# flowgrad: a node's family by its op; a fused chain by its first step's op, else elementwise.
# A section of no node (the optimizer, transfers, the loss scale) by its direction.
OP_FAMILIES = {"matmul": "products", "matmul_parts": "products", "attention": "attention",
               "layernorm": "layernorm", "cross_entropy": "cross_entropy", "embedding": "embedding",
               "cast": "casts", "sum": "elementwise", "mean": "elementwise", "max": "elementwise",
               "min": "elementwise"}   # reductions: PyTorch's reduce kernels, counted as elementwise
DIRECTION_FAMILIES = {"optimizer": "optimizer", "transfer": "transfers"}

# PyTorch: a CUDA kernel's family, the first row a word of which its lower-cased name holds. Order
# matters: memory-efficient attention's kernels are CUTLASS's (fmha_cutlass...), layer norm's and the
# casts' are vectorized elementwise kernels, nll_loss's is a reduction.
KERNEL_FAMILIES = (
    ("attention", ("flash", "fmha", "scaled_dot_product", "sdpa", "attention")),
    ("products", ("gemm", "cutlass", "sm90_xmma", "xmma", "nvjet", "cublas")),
    ("layernorm", ("layer_norm", "gammabeta")),
    ("cross_entropy", ("cross_entropy", "log_softmax", "logsoftmax", "nll")),
    ("embedding", ("embedding", "index", "segment", "grad_weight")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("casts", ("copy_kernel", "to_copy")),
    ("transfers", ("memcpy", "memset")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "triton_")),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    return next((family for family, words in KERNEL_FAMILIES if any(w in low for w in words)), "other")


def node_family(node) -> str:
    """The family of a profiled section's node (None: a section of no node)."""
    op = node.attrs["steps"][0][0] if node.op == "fused" else node.op
    if op in OP_FAMILIES:
        return OP_FAMILIES[op]
    return "elementwise" if node.op == "fused" or _pointwise(op) else "other"


def _pointwise(op: str) -> bool:
    """One map op per element (what the planner fuses into chains)."""
    from flowgrad.exec_vulkan.lower import lowering_for

    low = lowering_for(op)
    return low is not None and low.pointwise is not None


def group(times) -> dict:
    """[(family, name, seconds)] of one step -> {"seconds": {family: s}, "other": {name: s}}."""
    seconds = dict.fromkeys(FAMILIES, 0.0)
    other: dict[str, float] = {}
    for family, name, s in times:
        seconds[family] += s
        if family == "other":
            other[name] = other.get(name, 0.0) + s
    return {"seconds": seconds, "other": other}


def medians(steps: list[dict]) -> dict:
    """Each family's (and each `other` kernel's) median over the steps' groupings."""
    names = dict.fromkeys(n for s in steps for n in s["other"])
    return {"seconds": {f: statistics.median(s["seconds"][f] for s in steps) for f in FAMILIES},
            "other": {n: statistics.median(s["other"].get(n, 0.0) for s in steps) for n in names}}


def flowgrad_sections(profile, nodes) -> list[tuple]:
    """GraphSession.profile(..., nodes=True)'s [(label, direction, seconds, node id)] as
    [(family, name, seconds)]: `nodes` the graph the profile's ids index."""
    out = []
    for label, direction, seconds, nid in profile:
        if nid is None:
            out.append((DIRECTION_FAMILIES.get(direction, "other"), label, seconds))
        else:
            node = nodes[nid]
            out.append((node_family(node), node.op, seconds))
    return out


def flowgrad_families(sess, feeds, optimizer, steps: int = PROFILED_STEPS) -> dict:
    """The graph path's training step (with `optimizer`, as timed), profiled section by section."""
    runner = sess.runner
    profile = runner.profile(sess.runner_feeds(feeds, True), steps, grads=False, optimizer=optimizer, nodes=True,
                             outputs=())
    # the profile holds each section's median already: one step's worth
    return {**group(flowgrad_sections(profile, runner.graph.nodes)), "timer": runner.timer, "steps": steps}


def kernel_times(events) -> list[tuple]:
    """torch.profiler's events -> [(family, kernel name, seconds)] of those that ran on the GPU."""
    from torch.autograd import DeviceType

    return [(kernel_family(e.name), e.name, e.time_range.elapsed_us() * 1e-6)
            for e in events if e.device_type == DeviceType.CUDA]


def torch_families(step, sync, steps: int = PROFILED_STEPS) -> dict:
    """A warmed-up PyTorch step's CUDA kernels, each step profiled on its own."""
    from torch.profiler import ProfilerActivity, profile

    per_step = []
    for _ in range(steps):
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            sync()
        per_step.append(group(kernel_times(prof.events())))
    return {**medians(per_step), "timer": "torch.profiler (CUDA kernels)", "steps": steps}


def report(rows: list[dict], missing: list[str]) -> list[str]:
    """The table of the rows that carry `families`, ms per step, the first (flowgrad's) over
    each other's; then each column's `other` kernels, and what is missing."""
    cols = [r for r in rows if "families" in r]
    if not cols:
        return missing
    widths = [max(len(c["name"]), 9) + 2 for c in cols]
    lines = ["GPU time per kernel family, ms per mixed-precision step (each family's median over the profiled steps)"]
    lines += [f"  {c['name']}: {c['families']['timer']}, {c['families']['steps']} steps" for c in cols]
    lines.append(f"{'family':<15}{cols[0]['name']:>{widths[0]}}"
                 + "".join(f"{c['name']:>{w}}{'ratio':>8}" for c, w in zip(cols[1:], widths[1:])))
    for family in FAMILIES + ("total",):
        ms = [family_seconds(c, family) * 1e3 for c in cols]
        lines.append(f"{family:<15}{ms[0]:>{widths[0]}.3f}" + "".join(
            f"{t:>{w}.3f}{f'{ms[0] / t:.2f}x' if t > 0 else '-':>8}" for t, w in zip(ms[1:], widths[1:])))
    for c in cols:
        other = sorted(c["families"]["other"].items(), key=lambda kv: -kv[1])
        if other:
            lines.append(f"other in {c['name']}: " + "; ".join(f"{n[:100]} {s * 1e3:.3f} ms" for n, s in other[:8])
                         + (f"; {len(other) - 8} more" if len(other) > 8 else ""))
    if len(cols) > 1:
        lines.append(f"ratio: {cols[0]['name']}'s time over the column's")
    return lines + missing


def family_seconds(row: dict, family: str) -> float:
    s = row["families"]["seconds"]
    return sum(s.values()) if family == "total" else s[family]
