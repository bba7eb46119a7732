"""Compiling a model, and explaining its plan, take work linear in its size.

Wall time on a shared machine is too noisy to assert on, so these tests count
work instead, which is the same on every run: the Python lines the
whole-graph passes execute (the planner's fusion, memory plan, refusals and
explain tables, the graph's own walks), traced with sys.settrace, for a model
of N statements and one of 4N. Linear passes run about 4 times the lines (a little under: the
fixed cost of a compile is shared); one that scans the graph for each node
runs 16 times the lines of its scan, which at these sizes already took the
ratio past 5 (a fusion check that scanned every reader of a value that every
statement reads, a memory plan that scanned every buffer still in use for
each tensor).

The lowerings' own dry runs are left out of the count: a fixed cost per node
that would only hide a pass's growth. The generators also make the large
models to profile a compile with (`fg.loads(chain_model(8000)).compile()`)."""
from __future__ import annotations

import sys
from pathlib import Path

import flowgrad as fg
from flowgrad.exec_vulkan import recorder
from flowgrad.explain import explain
from flowgrad.exec_vulkan.fusion import fuse

PACKAGE = Path(fg.__file__).parent
# the modules whose passes walk the whole graph
PASSES = tuple(str(PACKAGE / p) for p in ("planner", "exec_vulkan/fusion.py", "exec_vulkan/memory.py", "explain.py", "graph.py",
                                          "grad_paths.py", "graph_check.py", "host_memory.py"))


def chain_model(n: int) -> str:
    """n statements, each reading the one before: products, bias adds,
    activations and residuals, with the model's input and a bias read all along."""
    steps = ["h{k} = h{p} @ w", "h{k} = h{p} + b", "h{k} = relu(h{p})", "h{k} = h{p} * 0.5 + h{q}",
             "h{k} = tanh(h{p})", "h{k} = h{p} - x"]
    lines = ["model chain", "input x: f32[4, 8]", "param w: f32[8, 8] = xavier()", "param b: f32[8] = zeros()",
             "h0 = x"]
    lines += [steps[k % len(steps)].format(k=k, p=k - 1, q=max(k - 3, 0)) for k in range(1, n + 1)]
    lines += [f"loss = mean(h{n} * h{n})", f"output h{n}", "minimize loss"]
    return "\n".join(lines) + "\n"


def nested_model(outer: int, n: int = 3) -> str:
    """Repeats of blocks that repeat blocks: `outer` instances of `n` of `n`."""
    return f"""model nested
config {{
  d = 8
}}
block inner(x) {{
  param w: f32[d, d] = xavier()
  param b: f32[d] = zeros()
  h = relu(x @ w + b)
  return x + h * 0.5
}}
block middle(x) {{
  y = repeat({n}, inner, x)
  return tanh(y) + x
}}
block outer(x) {{
  y = repeat({n}, middle, x)
  return y - x * 0.1
}}
input x: f32[4, d]
y = repeat({outer}, outer, x)
loss = mean(y * y)
output y
minimize loss
"""


def lines_run(run) -> int:
    """Lines of PASSES executed by run()."""
    count = 0

    def line(frame, event, arg):
        nonlocal count
        count += event == "line"
        return line

    def call(frame, event, arg):
        return line if frame.f_code.co_filename.startswith(PASSES) else None

    before = sys.gettrace()
    sys.settrace(call)
    try:
        run()
    finally:
        sys.settrace(before)
    return count


def compiled(text: str) -> int:
    """Lines of PASSES executed loading and compiling `text` for the CPU."""
    return lines_run(lambda: fg.loads(text).compile(device="cpu"))


def test_a_long_chain_compiles_in_linear_work():
    small, large = compiled(chain_model(200)), compiled(chain_model(800))
    assert large / small < 4.6, f"4x the statements ran {large / small:.2f}x the lines ({small} -> {large})"


def test_nested_repeats_compile_in_linear_work():
    small, large = compiled(nested_model(6)), compiled(nested_model(24))
    assert large / small < 4.6, f"4x the instances ran {large / small:.2f}x the lines ({small} -> {large})"


def test_explaining_a_long_chain_is_linear_work():
    """explain's table of nodes names each one's fused group (it rebuilt the
    map of groups for every node)."""
    def explained(n):
        sess = fg.loads(chain_model(n)).compile(device="cpu")
        return lines_run(lambda: explain(sess).text())

    small, large = explained(200), explained(800)
    assert large / small < 4.6, f"4x the statements ran {large / small:.2f}x the lines ({small} -> {large})"


def test_fusion_dry_runs_each_shape_of_chain_once(monkeypatch):
    """A model repeats a few shapes of chain; fusion records each on a dry run
    once, however long the model (they were most of a long model's compile)."""
    runs = []

    class Counted(recorder.Recorder):
        def __init__(self, *args, **kwargs):
            runs.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(recorder, "Recorder", Counted)
    counts = []
    for n in (60, 240):
        runs.clear()
        groups = fuse(fg.loads(chain_model(n)).graph).groups
        counts.append(len(runs))
        assert len(groups) >= n // 7    # it fused along the whole chain
    assert counts[0] == counts[1]


def test_thousands_of_reshapes_in_a_row_compile():
    """Their gradients (views too) lie inside one another's, placed up the
    chain in a loop: by recursion, 1,500 views passed Python's limit."""
    lines = ["model views", "input x: f32[4, 8]", "param b: f32[8] = zeros()", "h0 = x + b"]
    lines += [f"h{k} = reshape(h{k - 1}, {[8, 4] if k % 2 else [4, 8]})" for k in range(1, 1501)]
    lines += ["loss = mean(h1500 * h1500)", "output h1500", "minimize loss"]
    plan = fg.loads("\n".join(lines) + "\n").compile(device="cpu").plan
    step = plan.step_for(True)
    views = {n.id for n in plan.graph.nodes if n.op == "reshape"}
    grads = [n.id for n in step.graph.nodes if n.grad_of in views and n.op == "reshape"]
    # each view's gradient is a view of the one before it, so all lie in one buffer
    assert len(grads) == 1500 and len({plan.memory.slots[("val", i)].buffer for i in grads}) == 1
