"""`explain`: the plan a session carries out, and why, like a database's EXPLAIN.

The JSON form (`to_dict`) is the source of truth; the text form renders it,
its node table with the graph's own printer (one line per node, as
`str(graph)` prints it) and each node's verdict.
Its schema is docs/explain.schema.json, described in docs/explain.md; the
top-level "version" changes only on breaking changes."""
from __future__ import annotations

import statistics
import time

import attrs

from flowgrad.feeds import random_feeds
from flowgrad.graph import LEAF_OPS, Graph, Node, TensorType, format_node
from flowgrad.objectives import objective_graphs, several
from flowgrad.ops import get_op
from flowgrad.planner.plan import DryLimits, Plan, Refusal, spread_kernels

EXPLAIN_VERSION = 1


@attrs.define
class Explain:
    data: dict
    graph: Graph

    def to_dict(self) -> dict:
        return self.data

    def text(self) -> str:
        return render_text(self.data, self.graph)

    def __str__(self) -> str:
        return self.text()


def explain(sess, analyze: bool = False, steps: int = 5) -> Explain:
    plan, graph = sess.plan, sess.graph
    # with several objectives, each is a step of its own (its graph and plan): the counts are their sums
    parts = list(zip(objective_graphs(graph), sess.plans)) if several(graph) else [(graph, plan)]
    refusals = list({(r.code, r.node.id if r.node is not None else None, r.message): r
                     for _g, p in parts for r in p.refusals}.values())
    refused = {r.node.id: r for r in refusals if r.node is not None}
    grad_nodes = frozenset().union(*(p.grad_nodes for _g, p in parts))
    recorded: dict = {}
    graph_plan = summed([graph_plan_dict(g, p, recorded if k == 0 else None) for k, (g, p) in enumerate(parts)])
    if len(parts) > 1 and graph_plan.get("submits") is not None:
        graph_plan["submits"] = 1   # the objectives' programs go in one submission (graph_session.step_together)
    kernels = node_kernels(plan, recorded)
    # each fused member's group node, by its label (a step graph's node may be one of its backward's)
    fused_in = ({m: plan.fusion.source.nodes[grp.node].label for m, grp in plan.fusion.group_of().items()}
                if plan.fusion is not None else {})
    data = {
        "version": EXPLAIN_VERSION,
        "model": graph.name,
        "file": graph.file,
        "device": device_dict(plan.device),
        "dtype": plan.dtype,
        "backward_asked": plan.backward,
        "path": plan.path,
        "last_path": plan.last_path,
        "reason": plan.reason,
        "counts": {
            "nodes": len(graph.nodes),
            "ops": sum(n.op not in LEAF_OPS for n in graph.nodes),
            "backward_nodes": len(grad_nodes),
            "refused_nodes": len(refused),
            "refusals": len(refusals),
        },
        "refusals": [refusal_dict(r) for r in refusals],
        "nodes": [node_dict(graph, n, grad_nodes, refused, kernels, fused_in) for n in graph.nodes],
        "saved_for_backward": summed([saved_dict(p) for _g, p in parts]),
        "fusion": fusion_dict(graph, plan),
        "backward_graph": backward_dict(plan),
        "graph_plan": graph_plan,
        "closure_plan": summed([closure_plan_dict(g, p) for g, p in parts]),
        "analyze": run_analyze(sess, steps) if analyze else None,
    }
    if several(graph) or any(o.over is not None for o in graph.objectives):
        data["objectives"] = objectives_dict(graph)
    budgeted = [(g, p) for g, p in parts if p.training.recompute is not None]
    if budgeted:   # compile(memory_budget=...): what the backward computes again to fit it
        data["memory_budget"] = budget_dict(budgeted)
    if graph.frozen:   # params held fixed: no gradient, no update (Model.compile(freeze=...))
        data["frozen"] = [name for name in graph.params if name in graph.frozen]
    if plan.dtype == "mixed":
        data["precision"] = precision_dict(sess, kernels)
    ranks = getattr(sess, "ranks", 1)   # set by data-parallel training and `explain --ranks`, with grad_buckets
    if ranks > 1:
        data["ranks"] = ranks_dict(ranks, plan.path, getattr(sess, "grad_buckets", 1), len(parts))
    return Explain(data, graph)


def budget_dict(parts) -> dict:
    """The memory budget, the planned peak with and without recomputation
    and the bytes of the step's buffers (with several objectives, the
    largest of theirs), and the forward nodes the backward computes again."""
    done = [(g, p.training.recompute) for g, p in parts]
    return {"budget_bytes": done[0][1].budget,
            "planned_bytes_without": max(r.bytes_before for _g, r in done),
            "planned_bytes": max(r.bytes_after for _g, r in done),
            "buffer_bytes": max(p.training.memory.total_bytes for _g, p in parts),
            "nodes": [{"node": g.nodes[n.node].label, "node_id": n.node, "op": g.nodes[n.node].op,
                       "where": where_dict(g.nodes[n.node].span)} for g, r in done for n in r.nodes]}


def ranks_dict(ranks: int, path: str, buckets: int, objectives: int = 1) -> dict:
    """Data-parallel training on `ranks` ranks, its gradients all-reduced in
    `buckets` buckets: how a training step changes (each objective's in turn)."""
    if path == "graph":
        each = " each objective's in turn:" if objectives > 1 else ""
        step = (f"{each} forward+backward submit, the packed gradients read back and averaged across ranks "
                f"(all-reduce), optimizer submit: {2 * objectives} submits per step").lstrip()
        submits = 2 * objectives
    else:
        if buckets == 1:
            # one bucket is posted when the last gradient is final, i.e. after the whole backward
            step = ("forward and backward closures, then the gradients (one bucket, within "
                    "FLOWGRAD_MPI_BUCKET_MB) averaged across ranks (all-reduce), optimizer update")
        else:
            step = (f"forward and backward closures, each of the {buckets} gradient buckets averaged across "
                    "ranks (all-reduce) as soon as its gradients are final, while the backward goes on, "
                    "optimizer update")
        submits = None
    return {"count": ranks, "submits_per_step": submits, "step": step}


def precision_dict(sess, kernels: dict) -> dict:
    """dtype="mixed": what runs in which precision, and the loss scale."""
    graph = sess.graph
    masters = [graph.nodes[i] for i in graph.trainable().values() if graph.nodes[i].dtype == "f32"]
    f32_ops = [f"{n.label} ({n.op})" for n in graph.nodes if n.op not in LEAF_OPS and n.op != "cast" and n.dtype == "f32"]
    kernels: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "matmul":
            for k in kernels.get(n.id, {}).get("forward", []) + kernels.get(n.id, {}).get("backward", []):
                kernels[k] = kernels.get(k, 0) + 1
    scaler = sess.loss_scaler
    half = sess.mixed.half
    return {
        "half": half,
        "half_reason": sess.mixed.summary,
        "master_params": len(masters),
        "master_bytes": sum(n.type.nbytes for n in masters),
        "params": f"f32, updated by the optimizer with f32 state; the model reads them through {half} casts",
        "compute": f"{half} storage, f32 arithmetic: reductions, softmax, layernorm, attention and matmul products "
                   "accumulate in f32",
        "f32_ops": f32_ops,
        "matmul_kernels": kernels,
        "loss_scale": None if scaler is None else {
            "scale": scaler.scale, "growth": scaler.growth, "backoff": scaler.backoff,
            "interval": scaler.interval, "skipped_steps": scaler.skipped},
    }


def device_dict(info) -> dict:
    if info is None:
        return {"kind": "cpu", "name": "numpy (CPU)"}
    return {"kind": "vulkan", "name": info.name, "type": info.type, "memory_bytes": int(info.memory)}


def where_dict(span) -> dict | None:
    if span is None:
        return None
    return {"file": span.file, "line": span.line, "col": span.col,
            "via": [{"file": s.file, "line": s.line, "col": s.col} for s in span.via]}


def refusal_dict(r: Refusal) -> dict:
    node = r.node
    return {
        "code": r.code,
        "node": None if node is None else node.label,
        "node_id": None if node is None else node.id,
        "op": None if node is None else node.op,
        "where": None if node is None else where_dict(node.span),
        "message": r.message,
        "hint": r.hint,
    }


def node_kernels(plan: Plan, recorded: dict) -> dict:
    """Each node's kernels on the planned device: as the graph plan's dry run of
    the whole step records them (a fused chain's members take what their node
    runs, a backward node's go to the node it differentiates; nothing is
    recorded for a view), else each node's own dry run (plan.kernels)."""
    if not recorded or not plan.kernels:   # no device planned for: no kernels to name
        return plan.kernels
    runs = [(d, nid, k[d]) for nid, k in recorded.items() for d in ("forward", "backward")]
    return plan.kernels | spread_kernels(plan.training, runs)


def objectives_dict(graph: Graph) -> list[dict]:
    """Each `minimize`, in the order a training step applies them, and the params it updates."""
    return [{"name": o.name, "where": where_dict(o.span), "params": list(g.trainable())}
            for o, g in zip(graph.objectives, objective_graphs(graph))]


def summed(parts: list[dict]) -> dict:
    """Several objectives' plans as one step's: counts and sizes added, lists
    joined, flags and labels the first's; a memory's reuse from the sums."""
    out = dict(parts[0])
    if len(parts) == 1:
        return out
    for part in parts[1:]:
        for key, value in part.items():
            if isinstance(value, bool) or value is None or out.get(key) is None:
                continue
            if isinstance(value, (int, float)):
                out[key] += value
            elif isinstance(value, list):   # node labels once each; each program's tensors all
                out[key] = out[key] + [v for v in value if not isinstance(v, str) or v not in out[key]]
            elif isinstance(value, dict):
                out[key] = summed([out[key], value])
    if "naive_bytes" in out and "reuse" in out:
        out["reuse"] = round(1 - out["total_bytes"] / out["naive_bytes"], 4) if out["naive_bytes"] else 0.0
    return out


def node_dict(graph: Graph, node: Node, grad_nodes: frozenset, refused: dict, kernels: dict,
              fused_in: dict) -> dict:
    """grad_nodes: the nodes some objective's backward runs through. fused_in:
    the label of each fused member's group node (made once for all the nodes)."""
    if node.op == "param" and node.name in graph.frozen:
        verdict = "frozen"
    elif node.op in LEAF_OPS:
        verdict = node.op
    elif node.id in refused:
        verdict = f"refused:{refused[node.id].code}"
    else:
        verdict = "ok"
    out = {
        "id": node.id,
        "name": node.label,
        "op": node.op,
        "inputs": [graph.nodes[i].label for i in node.inputs],
        "shape": list(node.shape),
        "dtype": node.dtype,
        "where": where_dict(node.span),
        "backward": node.id in grad_nodes,
        "verdict": verdict,
    }
    if node.grad_of is not None:   # a node of a backward built in the model (grad(y, x))
        out["grad_of"] = node.grad_of
    if node.op == "scan":   # its cell, held once, run `steps` times
        body = node.attrs["body"]
        out["scan"] = {"cell": body.name, "steps": node.attrs["steps"], "reverse": node.attrs["reverse"],
                       "body": [format_node(n) for n in body.graph.nodes]}
    if node.id in kernels:   # planned for a device: the kernels its lowering dispatches there
        out["kernels"] = kernels[node.id]
    if node.id in fused_in:
        out["fused_into"] = fused_in[node.id]
    return out


def backward_dict(plan: Plan) -> list[dict]:
    """The backward the autodiff pass appended to the training step's graph:
    each node it runs (a fused chain as one), with the forward node it
    differentiates (`grad_of`, `of`) and that node's line."""
    step = plan.training
    g, src, group_of = step.graph, step.fusion.source, step.fusion.group_of()
    out = []
    for s in step.memory.schedule:
        n = g.nodes[s.node]
        if n.grad_of is None:
            continue
        d = {"id": n.id, "op": n.op, "grad_of": n.grad_of, "of": g.nodes[n.grad_of].label, "shape": list(n.shape),
             "dtype": n.dtype, "where": where_dict(n.span)}
        if n.op == "fused":
            d["ops"] = [src.nodes[m].op for m in group_of[n.id].members]
        out.append(d)
    return out


def fusion_dict(graph: Graph, plan: Plan) -> dict:
    """The pointwise chains the graph path runs as one node each (exec_vulkan/fusion.py)."""
    groups = plan.fusion.groups if plan.fusion is not None else []
    if plan.fusion is not None and plan.fusion.source is not None:   # a step graph's: its backward's nodes too
        graph = plan.fusion.source
    return {
        "groups": [{"node": graph.nodes[grp.node].label, "node_id": grp.node,
                    "ops": [graph.nodes[m].op for m in grp.members],
                    "members": [graph.nodes[m].label for m in grp.members], "member_ids": list(grp.members),
                    "inputs": [graph.nodes[i].label for i in grp.inputs]} for grp in groups],
        "fused_ops": sum(len(grp.members) for grp in groups),
        "split_products": [{"node": graph.nodes[sp.node].label, "node_id": sp.node,
                            "parts": [graph.nodes[p].label for p in sp.parts]}
                           for sp in (plan.fusion.splits if plan.fusion is not None else [])],
    }


def saved_dict(plan: Plan) -> dict:
    """What the backward keeps from the forward (each backward node's VJP reads
    its inputs and output); params and consts are resident anyway."""
    saved = plan.memory.saved
    return {
        "bytes": sum(s.nbytes for s in saved),
        "tensors": [{"name": s.node.label, "op": s.node.op, "shape": list(s.shape), "dtype": s.dtype,
                     "bytes": s.nbytes, "where": where_dict(s.node.span)} for s in saved],
    }


def graph_plan_dict(graph: Graph, plan: Plan, recorded: dict | None = None) -> dict:
    """Dispatches and memory of the graph path, planned without a device.
    Nodes that have no lowering can't be counted: they are listed as refused.
    `recorded`, when given, receives the kernels each node's section recorded."""
    from flowgrad.exec_vulkan import count_dispatches

    from flowgrad.errors import FlowError

    uncountable = [r.node.label for r in plan.refusals if r.node is not None and r.code in
                   ("no-op-record", "no-lowering")]
    counts = None
    if not uncountable:
        try:
            counts = count_dispatches(graph, plan)
        except (FlowError, ValueError):
            # a lowering that refuses its node's shapes (a `limit` refusal) can't be recorded to
            # count it either; explain must still show the plan and that refusal
            uncountable = [r.node.label for r in plan.refusals if r.node is not None and r.code == "limit"]
            if not uncountable:
                raise
    out = {"chosen": plan.path == "graph", "uncounted_nodes": uncountable}
    if uncountable:
        out.update(dispatches=None, submits=None, transfers_in=None, transfers_out=None, memory=None)
        return out
    if recorded is not None:
        recorded.update(counts["kernels"])
    mem = plan.memory
    out.update(
        submits=1,
        dispatches=counts["forward"] + counts["backward"],
        dispatches_forward=counts["forward"],
        dispatches_backward=counts["backward"],
        transfers_in=counts["transfers_in"],
        transfers_out=counts["transfers_out"],
        memory={"buffers": len(mem.buffers), "total_bytes": mem.total_bytes, "naive_bytes": mem.naive_bytes,
                "peak_bytes": mem.peak_bytes, "reuse": mem.reuse,
                "kernel_bytes": counts["scratch_bytes"] + counts["kept_bytes"]},
    )
    return out


def closure_plan_dict(graph: Graph, plan: Plan) -> dict:
    """One kernel call per op of the step: the forward's, then those of the
    backward the autodiff pass appends (what the closure executor runs); on
    a Vulkan device each that runs there (exec_vulkan.kernels.VulkanKernels)
    is its own submit, uploading its inputs and reading back its result; one
    without a lowering that takes it runs on numpy (_closure_traffic)."""
    from flowgrad.autodiff import backward_graph

    fwd = [n for n in graph.needed_for(graph.roots()) if n.op not in LEAF_OPS]
    step_graph, bwd = graph, []
    if graph.loss is not None:
        step = backward_graph(graph, [i for i in graph.trainable().values() if graph.nodes[i].dtype != "i32"])
        if plan.recomputed:   # as the closure executor runs it: the clones among the backward's calls
            from flowgrad.recompute import rewrite

            out = rewrite(step.graph, step.seed + 1, plan.recomputed)
            step = attrs.evolve(step, graph=out.graph, grads={x: out.ids.get(i, i) for x, i in step.grads.items()})
        step_graph, ran = step.graph, {n.id for n in fwd}
        bwd = [n for n in step.graph.needed_for(list(step.grads.values()))
               if n.op not in LEAF_OPS and n.id not in ran]
    calls = len(fwd) + len(bwd)
    if plan.device is None:
        return {"chosen": plan.path != "graph", "kernel_calls": calls, "submits": None,
                "transfers_in": None, "transfers_out": None}
    submits = ins = outs = 0
    for n in fwd + bwd:
        s, i, o = _closure_traffic(step_graph, plan, n)
        submits, ins, outs = submits + s, ins + i, outs + o
    return {"chosen": plan.path != "graph", "kernel_calls": calls, "submits": submits,
            "transfers_in": ins, "transfers_out": outs}


def _closure_traffic(graph: Graph, plan: Plan, node: Node) -> tuple[int, int, int]:
    """(submits, uploads, read-backs) of one kernel call of Vulkan closures
    (exec_vulkan.kernels.VulkanKernels): it records the call with
    VulkanKernels' own `kernels.record_call`, dry, against the planned
    device's limits; where that says numpy (no lowering takes the dtypes, or
    the lowering refuses the shapes) the call sends nothing, since
    VulkanKernels uploads only what it has recorded."""
    from flowgrad.exec_vulkan.kernels import record_call
    from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer, Recorder

    def empty(shape, dtype):
        return BufView(FakeBuffer(max(TensorType(shape, dtype).nbytes, 4)), 0, shape, dtype)

    types = [graph.nodes[i].type for i in node.inputs]
    if record_call(Recorder(DryLimits(plan.device)), node, types, empty) is None:
        return 0, 0, 0
    return 1, len(types), 1 + len(get_op(node.op).updates)   # the result, and the state it updates in place


def run_analyze(sess, steps: int) -> dict:
    from flowgrad.errors import DeviceError, FlowError

    feeds = random_feeds(sess.graph)
    grads = sess.graph.loss is not None
    try:
        sess.step(feeds, grads=grads)  # warm-up: pipelines built, command buffer recorded
    except DeviceError:
        raise
    except FlowError as e:
        # the model's error alone reads as a fault of the model or its data, which it may not be
        raise FlowError(f"explain --analyze steps on random feeds (floats from N(0, 1), integer inputs 0), "
                        f"and this model can't take them: {e.message}", e.span,
                        (f"{e.hint}; " if e.hint else "") + "a model that computes indices from its float inputs "
                        "needs real rows: time it with `flowgrad bench FILE`, which steps on the first batch of "
                        "its train section's data") from e
    step_times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sess.step(feeds, grads=grads)
        step_times.append(time.perf_counter() - t0)
    per_op = sess.runner.profile(sess.runner_feeds(feeds, grads), steps, grads=grads, nodes=True)
    total = sum(row[2] for row in per_op) or 1.0
    top = sorted(per_op, key=lambda r: -r[2])
    # by node id, in the graph the runner runs (the fused one on the graph path only): a label
    # may name several nodes (`h = relu(h)`), and closures run the unfused graph
    ran = sess.runner.graph.nodes
    return {
        "steps": steps,
        "step_seconds_median": statistics.median(step_times),
        "timer": sess.runner.timer,
        "ops": [{"node": label, "op": direction if nid is None else ran[nid].op, "direction": direction,
                 "seconds": t, "share": t / total} for label, direction, t, nid in top],
    }


# ---------------------------------------------------------------- text form

def render_text(d: dict, graph: Graph) -> str:
    c = d["counts"]
    dev = d["device"]["name"]
    if d["path"] == "graph":
        head = f"{d['model']}: backward on GRAPH, 0 of {c['ops']} ops refused (device: {dev}, {d['dtype']})"
    else:
        head = (f"{d['model']}: backward on CLOSURES, {c['refused_nodes']} of {c['ops']} ops refused, "
                f"{c['refusals']} refusal{'s' * (c['refusals'] != 1)} (device: {dev}, {d['dtype']})")
    lines = [head, f"why: {d['reason']}", ""]
    if "objectives" in d:
        lines[-1:] = render_objectives(d["objectives"], d["path"]) + [""]
    if "frozen" in d:
        lines[-1:] = [f"frozen: {', '.join(d['frozen'])} (no gradient, no update)", ""]
    if "ranks" in d:
        lines[-1:] = [f"ranks: {d['ranks']['count']}, data-parallel: {d['ranks']['step']}", ""]
    if "memory_budget" in d:
        lines[-1:] = [*render_budget(d["memory_budget"]), ""]
    if d["refusals"]:
        lines += ["refusals", *render_refusals(d["refusals"]), ""]
    lines += [*render_plans(d), ""]
    if "precision" in d:
        lines += ["precision (mixed)", *render_precision(d["precision"]), ""]
    if d["fusion"]["groups"] or d["fusion"]["split_products"]:
        lines += ["fused (one node each on the graph path)", *render_fusion(d["fusion"]), ""]
    lines += ["nodes", *render_nodes(d, graph), ""]
    if d["backward_graph"]:
        lines += ["backward (the step graph's nodes, by the node each differentiates)",
                  *render_backward(d["backward_graph"]), ""]
    if d["analyze"]:
        lines += render_analyze(d["analyze"])
    return "\n".join(lines).rstrip() + "\n"


def render_backward(nodes: list[dict], width: int = 118) -> list[str]:
    """One line per forward node: the backward nodes that differentiate it, in the order they run."""
    by: dict[str, list[str]] = {}
    for n in nodes:
        ops = n.get("ops")
        by.setdefault(n["of"], []).append(n["op"] if ops is None else
                                          f"fused[{ops[0]}..{ops[-1]}]" if len(ops) > 3 else f"fused[{','.join(ops)}]")
    lines = []
    for of, ops in by.items():
        line = f"  {of:<12} <- {', '.join(ops)}"
        lines.append(line if len(line) <= width else line[:width - 3] + "...")
    return lines


def render_budget(b: dict) -> list[str]:
    """The budget, the planned peaks, and each recomputed node with its line."""
    lines = [f"memory budget: {mib(b['budget_bytes'])}; planned peak {mib(b['planned_bytes'])}, "
             f"{mib(b['planned_bytes_without'])} without recomputation; buffers {mib(b['buffer_bytes'])}"]
    if not b["nodes"]:
        return lines + ["  fits without recomputing anything"]
    lines.append(f"  recomputed in the backward ({len(b['nodes'])} forward nodes):")
    lines += [f"    {n['node']:<16} {n['op']:<12} {where_text(n['where'])}".rstrip() for n in b["nodes"]]
    return lines


def render_objectives(objectives: list[dict], path: str) -> list[str]:
    each = "its own program, all in one submit" if path == "graph" else "its own forward, backward and update"
    lines = [f"objectives, applied in this order each step ({each}):" if len(objectives) > 1 else "objective:"]
    for k, o in enumerate(objectives, 1):
        lines.append(f"  {k}. {o['name']} over {', '.join(o['params']) or 'no trainable param'}   "
                     f"{where_text(o['where'])}".rstrip())
    return lines


def where_text(w: dict | None, file: str | None = None) -> str:
    if w is None:
        return ""
    text = f"{w['file']}:{w['line']}:{w['col']}"
    for site in w["via"]:
        prefix = "" if site["file"] == w["file"] else site["file"]
        text += f" (via {prefix}:{site['line']}:{site['col']})"
    return text


def render_refusals(refusals: list[dict]) -> list[str]:
    lines, seen = [], set()
    for r in refusals:
        lines.append(f"  [{r['code']}] " + (f"{r['node']} = {r['op']}   {where_text(r['where'])}"
                                              if r["node"] else r["message"]))
        key = (r["code"], r["message"], r["hint"])
        if key in seen:
            lines.append("          (same reason)")
            continue
        seen.add(key)
        if r["node"]:
            lines.append(f"          {r['message']}")
        if r["hint"]:
            lines.append(f"          hint: {r['hint']}")
    return lines


def mib(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def render_plans(d: dict) -> list[str]:
    g, c = d["graph_plan"], d["closure_plan"]
    g_title = "graph (chosen)" if g["chosen"] else "graph (refused)"
    c_title = "closures (chosen)" if c["chosen"] else "closures"
    if g["dispatches"] is None:
        g_disp = g_io = g_mem = g_kmem = f"not planned: {len(g['uncounted_nodes'])} node(s) it can't record"
    else:
        g_disp = f"{g['submits']} submit{'s' * (g['submits'] != 1)} / {g['dispatches']} dispatches"
        g_io = f"{g['transfers_in']} in, {g['transfers_out']} out"
        m = g["memory"]
        # what the buffers hold (what is allocated, and what a memory refusal compares), not
        # peak_bytes, the most live at once: a lower bound no packing of these buffers reaches
        g_mem = f"{mib(m['total_bytes'])} in {m['buffers']} buffers (reuse {m['reuse']:.0%})"
        g_kmem = f"{mib(m['kernel_bytes'])} (scratch, kept for backward)"
    if c["submits"] is None:
        c_disp, c_io = f"{c['kernel_calls']} numpy kernel calls", "none (host memory)"
    else:
        c_disp, c_io = f"{c['submits']} submits", f"{c['transfers_in']} in, {c['transfers_out']} out"
    s = d["saved_for_backward"]
    rows = [("plan", g_title, c_title), ("dispatches", g_disp, c_disp), ("host transfers", g_io, c_io),
            ("memory", g_mem, "n/a (allocated per op)"), ("kernel memory", g_kmem, "")]
    out = [f"{a:<16}{b:<44}{c_}".rstrip() for a, b, c_ in rows]
    out.append(f"{'saved for bwd':<16}{mib(s['bytes'])} in {len(s['tensors'])} tensors")
    return out


def render_precision(p: dict) -> list[str]:
    lines = [f"  computes in     {p['half_reason']}",
             f"  params          {p['master_params']} ({mib(p['master_bytes'])}) {p['params']}",
             f"  compute         {p['compute']}",
             f"  in f32          {', '.join(p['f32_ops']) or 'nothing'}"]
    if p["matmul_kernels"]:
        lines.append("  matmul kernels  " + ", ".join(f"{k} x{n}" for k, n in sorted(p["matmul_kernels"].items())))
    ls = p["loss_scale"]
    if ls is None and p["half"] == "bf16":
        lines.append("  loss scale      none: bf16 has f32's range (no scaler, no skipped steps)")
    if ls is not None:
        lines.append(f"  loss scale      {ls['scale']:g} (x{ls['growth']:g} after {ls['interval']} good steps, "
                     f"x{ls['backoff']:g} and the step skipped on an overflow; {ls['skipped_steps']} skipped)")
    return lines


def render_fusion(f: dict) -> list[str]:
    def chain(grp):
        steps = [f"{op} %{i}" for op, i in zip(grp["ops"], grp["member_ids"])]
        if len(steps) > 4:   # a backward's long chain (gelu's derivative): its ends and its length
            steps = steps[:2] + [f"... {len(steps) - 3} more"] + steps[-1:]
        reads = grp["inputs"] if len(grp["inputs"]) <= 4 else grp["inputs"][:4] + [f"{len(grp['inputs']) - 4} more"]
        return f"{' -> '.join(steps)}   reads {', '.join(reads)}"

    return [f"  {grp['node']:<12} = {chain(grp)}" for grp in f["groups"]] + [
        f"  {sp['node']:<12} = {len(sp['parts'])} blocks of a matmul, read in place as {', '.join(sp['parts'])}"
        for sp in f["split_products"]]


def render_nodes(d: dict, graph: Graph) -> list[str]:
    printed = [format_node(node) for node in graph.nodes]
    width = max(map(len, printed), default=0)
    lines = []
    for text, n in zip(printed, d["nodes"]):
        verdict = "" if n["verdict"] in LEAF_OPS else n["verdict"] + (" +bwd" if n["backward"] else "")
        lines.append(f"  {text:<{width}}  {verdict:<10} {kernels_text(n.get('kernels'))}".rstrip())
        if "scan" in n:
            s = n["scan"]
            lines.append(f"    | cell {s['cell']}, run {s['steps']} times{' in reverse' * s['reverse']}:")
            lines += [f"    |   {line}" for line in s["body"]]
    return lines


def kernels_text(k: dict | None) -> str:
    if not k:
        return ""
    parts = [f"{label} {', '.join(k[d])}" for d, label in (("forward", "fwd"), ("backward", "bwd")) if k[d]]
    return "kernels: " + (" | ".join(parts) or "none (a view)")


def render_analyze(a: dict) -> list[str]:
    lines = [f"analyze ({a['steps']} steps, {a['timer']}): step median {a['step_seconds_median'] * 1e3:.2f} ms",
             "  top ops by time"]
    for op in a["ops"][:10]:
        lines.append(f"    {op['node'] + ' ' + op['op']:<34} {op['direction']:<9} {op['seconds'] * 1e3:9.3f} ms"
                     f"  {op['share']:6.1%}")
    return lines
