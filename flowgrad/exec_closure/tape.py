"""The closure executor: the step's graph (forward, then the backward the
autodiff pass appends) run node by node.

The executor never looks at op names: each node is its op's forward, run by
a kernel backend (numpy here; exec_vulkan supplies one that runs each op's
lowering on the device, one op at a time)."""
from __future__ import annotations

import time

import attrs
import numpy as np

from flowgrad.dtypes import as_dtype
from flowgrad.errors import FlowError
from flowgrad.autodiff import backward_graph
from flowgrad.recompute import rewrite
from flowgrad.grad_paths import updated_params
from flowgrad.graph import Graph, Node
from flowgrad.ops import get_op
from flowgrad.ops.checks import at_node, check_index_inputs
from flowgrad.update_counts import Counts


class NumpyKernels:
    name = "numpy"

    def forward(self, node: Node, ins: list[np.ndarray]) -> np.ndarray:
        out = get_op(node.op).forward(ins, node.attrs)
        return as_dtype(out, node.dtype)   # a bf16 node's f32 result rounds once, as its store does

    def vjp(self, node: Node, g, ins, out) -> list:
        grads = get_op(node.op).vjp(g, ins, out, node.attrs)
        return [None if d is None else np.asarray(d, dtype=x.dtype) for d, x in zip(grads, ins)]


class ClosureExecutor:
    """Runs a graph node by node: the forward, then the backward the
    autodiff pass appended to it (flowgrad/autodiff.py), each node an op run
    on its own. `timings`, when a dict, collects wall time per node (for
    explain --analyze; a backward node's under the node it differentiates).
    recompute: forward nodes (by id) the backward computes again instead of
    keeping them (flowgrad/recompute.py): the forward then drops each value
    after its last reader, unless the backward or the step's result reads it."""

    path = "closures"

    def __init__(self, graph: Graph, kernels=None, recompute=frozenset()):
        self.graph = graph
        self.kernels = kernels or NumpyKernels()
        self.recompute = frozenset(recompute)
        self.timings: dict[int, list[float]] | None = None
        self._steps: dict[tuple, tuple] = {}

    def forward(self, feeds: dict[str, np.ndarray], params: dict[str, np.ndarray], roots, keep=None) -> dict:
        """Evaluate what `roots` need. Returns the values by node id: all of
        them, or with `keep` (ids), the roots and those only."""
        values: dict[int, np.ndarray] = {}
        order = self.graph.needed_for(roots)
        last = {i: pos for pos, node in enumerate(order) for i in node.inputs} if keep is not None else {}
        for pos, node in enumerate(order):
            if node.op == "input":
                values[node.id] = feeds[node.name]
            elif node.op == "param":
                values[node.id] = params[node.name]
            else:
                values[node.id] = self._run(self.graph, node, values)
            for i in set(node.inputs) if keep is not None else ():
                if last[i] == pos and i not in keep and i not in roots:
                    del values[i]
        return values

    def backward_reads(self, loss_id: int, grad_inputs: bool = False) -> set[int] | None:
        """The forward values the backward of loss_id reads, where it
        recomputes some (the forward need keep only these); else None."""
        if not self.recompute:
            return None
        step, nodes, _last = self.step_graph(loss_id, grad_inputs)
        return {i for node in nodes if node.id >= step.forward_nodes for i in node.inputs if i < step.forward_nodes}

    def _run(self, graph, node, values, backward=False):
        if node.op == "const":
            return as_dtype(node.attrs["value"], node.dtype)
        ins = [values[i] for i in node.inputs]
        check_index_inputs(graph, node, ins)
        t0 = time.perf_counter()
        out = at_node(node, lambda: self.kernels.forward(node, ins))
        if self.timings is not None:
            self.timings.setdefault((node.grad_of if backward else node.id, backward), []).append(
                time.perf_counter() - t0)
        if np.shape(out) != node.shape:
            raise FlowError(f"{node.op}: forward gave shape {list(np.shape(out))}, but the node is "
                            f"{node.type}", node.span)
        return out

    def step_graph(self, loss_id: int, grad_inputs: bool = False):
        """(StepGraph, its backward nodes in order, {node id: position of its
        last reader}): the loss's backward for the params (with grad_inputs,
        the float inputs too), built once."""
        key = (loss_id, grad_inputs)
        if key not in self._steps:
            g = self.graph
            wrt = [i for i in g.trainable().values() if g.nodes[i].dtype != "i32"]
            if grad_inputs:
                wrt += [i for i in g.inputs.values() if g.nodes[i].dtype != "i32"]
            step = backward_graph(g, wrt, loss_id)
            if self.recompute:
                out = rewrite(step.graph, step.seed + 1, self.recompute)
                step = attrs.evolve(step, graph=out.graph, grads={x: out.ids.get(i, i) for x, i in step.grads.items()})
            # the backward's nodes, and any forward node they read that the outputs and loss do not
            ran = {n.id for n in g.needed_for(g.roots())}   # by the forward (which may drop them after it)
            nodes = [n for n in step.graph.needed_for(list(step.grads.values()))
                     if n.op not in ("input", "param") and n.id != step.seed and n.id not in ran]
            last = {}
            for pos, node in enumerate(nodes):
                for i in node.inputs:
                    last[i] = pos
            self._steps[key] = (step, nodes, last)
        return self._steps[key]

    def backward(self, values: dict, loss_id: int, on_value=None, on_final=None, seed=None,
                 grad_inputs: bool = False) -> dict[int, np.ndarray]:
        """Gradients of values[loss_id] (a scalar) for each param (with
        grad_inputs, each float input too), by node id, starting from `seed`
        (1 unless given: a loss scale). on_value(node, value), when given,
        sees each backward node's value (anomaly detection); on_final(id, grad)
        is called for each param as soon as its gradient is final."""
        step, nodes, last = self.step_graph(loss_id, grad_inputs)
        loss = values[loss_id]
        vals = dict(values)
        vals[step.seed] = np.ones_like(loss) if seed is None else np.asarray(seed, dtype=np.asarray(loss).dtype)
        final: dict[int, list[int]] = {}
        for x, gid in step.grads.items():
            final.setdefault(gid, []).append(x)
        told = set()
        for pos, node in enumerate(nodes):
            if node.id in vals:
                continue
            vals[node.id] = self._run(step.graph, node, vals, backward=node.id >= step.forward_nodes)
            if on_value is not None and node.grad_of is not None:
                on_value(node, vals)
            if on_final is not None:
                for x in final.get(node.id, ()):
                    on_final(x, vals[node.id])
                    told.add(x)
            for i in set(node.inputs):   # a backward intermediate is freed after its last reader
                if i >= step.forward_nodes and last[i] == pos and i not in final:
                    del vals[i]
        grads = {}
        for x, gid in step.grads.items():
            if gid not in vals:   # a gradient no backward op computes: a zero constant
                vals[gid] = self._run(step.graph, step.graph.nodes[gid], vals, backward=True)
            grads[x] = vals[gid]
            if on_final is not None and x not in told:
                on_final(x, grads[x])
        return grads


class ClosureSession:
    """Owns the params (numpy) and runs steps through a ClosureExecutor.
    The graph executor offers the same methods with everything resident."""

    path = "closures"
    timer = "wall clock per op"

    def __init__(self, graph: Graph, params: dict[str, np.ndarray], kernels=None, scaler=None, params_of=None,
                 recompute=frozenset()):
        """params_of: a ClosureSession whose params this one steps (the
        objectives of a model: flowgrad/objectives.py), else its own copy of
        `params`. recompute: see ClosureExecutor."""
        self.graph = graph
        self.executor = ClosureExecutor(graph, kernels, recompute)
        self.params = params_of.params if params_of is not None else {k: v.copy() for k, v in params.items()}
        self.opt_state: dict = {}
        self.counts = Counts()
        self.scaler = scaler   # a loss_scale.LossScaler under dtype="mixed"
        self._updated_names = None

    def step(self, feeds, grads: bool = True, optimizer=None, grad_inputs: bool = False, on_grad_final=None,
             outputs=None):
        """on_grad_final(name, grad): see session.Session.step; here it is called
        during the backward, as each param's gradient becomes final. outputs: every
        output is on the host here, whichever are asked for."""
        # A diverging run overflows in op after op: numpy would print a
        # RuntimeWarning (file and source line) for each, ahead of the one clear
        # error the training loop or check_finite gives for the non-finite loss.
        # Every closure step (training, evals, `flowgrad run`, `explain --analyze`) runs here.
        with np.errstate(all="ignore"):
            return self._step(feeds, grads, optimizer, grad_inputs, on_grad_final)

    def _step(self, feeds, grads, optimizer, grad_inputs, on_grad_final):
        g = self.graph
        roots = g.roots()
        backward = (grads or optimizer is not None) and g.loss is not None
        keep = self.executor.backward_reads(g.loss, grad_inputs) if backward else None
        values = self.executor.forward(feeds, self.params, roots, keep)
        outputs = {name: values[i] for name, i in g.outputs.items()}
        loss = None if g.loss is None else values[g.loss]
        out_grads = {}
        found_inf = False
        if grads or optimizer is not None:
            trainable = g.trainable()
            names = {i: name for name, i in trainable.items()}
            inv = None if self.scaler is None else self.scaler.inv_scale()

            def final(i, d):
                if i in names:
                    on_grad_final(names[i], d if inv is None else (d * inv).astype(d.dtype))

            seed = None if self.scaler is None else self.scaler.seed()
            by_id = self.executor.backward(values, g.loss, on_final=final if on_grad_final else None,
                                           seed=seed, grad_inputs=grad_inputs)
            for name, i in trainable.items():
                out_grads[name] = by_id.get(i, np.zeros_like(self.params[name]))
            if grad_inputs:
                for name, i in g.inputs.items():
                    if i in by_id:
                        out_grads[name] = by_id[i]
            if self.scaler is not None:
                found_inf = self.scaler.unscale(out_grads)
        if optimizer is not None:
            self._apply(optimizer, out_grads, found_inf)
        return outputs, loss, out_grads

    def apply_update(self, optimizer, grads) -> None:
        """One optimizer update with the given gradients (in data-parallel
        training: averaged across ranks); under a loss scaler, skipped when
        one of them overflowed."""
        found_inf = self.scaler is not None and not all(np.isfinite(g).all() for g in grads.values())
        with np.errstate(all="ignore"):   # as in step: the loop reports a non-finite loss itself
            self._apply(optimizer, grads, found_inf)

    def _apply(self, optimizer, grads, found_inf: bool) -> None:
        """An update asked for: applied unless the loss scaler found an
        overflow, counted either way (update_counts.Counts)."""
        self._adopt(optimizer)
        if not found_inf:
            self._update(optimizer, grads)
        self.counts = self.counts.after(not found_inf)
        if self.scaler is not None:
            self.scaler.update(found_inf)

    def _adopt(self, optimizer) -> None:
        """An optimizer of another kind than the state's (sgd's momentum buffer,
        then adam): what it keeps goes on, the rest starts at zero, and its
        counts (Adam's bias correction, the schedule) start again, as a new
        torch optimizer's and its scheduler's; so on the graph path. Before
        counting this update, so that it is the first of the new ones."""
        kept = getattr(optimizer, "STATE", None)   # the state names a flowgrad optimizer keeps per param
        if not self.opt_state or kept is None or all(set(st) == set(kept) for st in self.opt_state.values()):
            return
        self.counts = Counts()
        state = optimizer.init_state(self._trained())
        for name, entries in state.items():
            entries.update({k: v for k, v in self.opt_state.get(name, {}).items() if k in entries})
        self.opt_state = state

    def _update(self, optimizer, grads) -> None:
        trained = self._trained()
        if not self.opt_state:
            self.opt_state = optimizer.init_state(trained)
        at = self.counts.after()
        updated = {name: trained[name] for name in self._updated()}
        optimizer.update(updated, grads, self.opt_state, at.updates, at.iterations)

    def _trained(self) -> dict[str, np.ndarray]:
        return {name: self.params[name] for name in self.graph.trainable()}  # the same arrays: updated in place

    def _updated(self) -> list[str]:
        """The params the optimizer updates: those the loss reaches."""
        if self._updated_names is None:
            self._updated_names = updated_params(self.graph)
        return self._updated_names

    def get_params(self, names=None):
        return {k: self.params[k].copy() for k in (self.params if names is None else names)}

    def set_params(self, values):
        for k, v in values.items():
            self.params[k] = np.array(v, dtype=self.params[k].dtype)

    def get_opt_state(self):
        """(Counts, {param: {state name: array}}), copies: for checkpoints."""
        return self.counts, {p: {k: v.copy() for k, v in s.items()} for p, s in self.opt_state.items()}

    def set_opt_state(self, counts: Counts, state) -> None:
        """Restore what get_opt_state returned (resume): the next update goes on from these counts."""
        self.counts = counts
        self.opt_state = {p: {k: np.array(v, dtype=np.float32) for k, v in s.items()} for p, s in state.items()}

    def profile(self, feeds, steps: int, grads: bool = True, nodes: bool = False) -> list[tuple]:
        """Median wall time per op and direction over `steps` steps:
        [(node label, direction, seconds)], and with nodes=True the node's id."""
        per_step = []
        try:
            for _ in range(steps):
                self.executor.timings = {}
                self.step(feeds, grads=grads)
                # a node's backward is several ops: their times add up within a step
                per_step.append({key: sum(ts) for key, ts in self.executor.timings.items()})
        finally:
            self.executor.timings = None
        graph_nodes = self.graph.nodes
        keys = dict.fromkeys(k for times in per_step for k in times)
        return [(graph_nodes[i].label, "backward" if bwd else "forward",
                 float(np.median([t.get((i, bwd), 0.0) for t in per_step]))) + ((i,) * nodes) for i, bwd in keys]
