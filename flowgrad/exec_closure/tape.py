"""Forward builds a tape of VJP closures; backward walks it in reverse.

The executor never looks at op names: each node's forward and VJP come from
its Op record, run by a kernel backend (numpy here; exec_vulkan supplies one
that runs each op's lowering on the device, one op at a time)."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.errors import FlowError
from flowgrad.grad_paths import backward_nodes, updated_params
from flowgrad.graph import Graph, Node
from flowgrad.ops import get_op
from flowgrad.ops.checks import at_node, check_index_inputs
from flowgrad.update_counts import Counts


class NumpyKernels:
    name = "numpy"

    def forward(self, node: Node, ins: list[np.ndarray]) -> np.ndarray:
        out = get_op(node.op).forward(ins, node.attrs)
        return np.asarray(out, dtype=NUMPY_DTYPE[node.dtype])

    def vjp(self, node: Node, g, ins, out) -> list:
        grads = get_op(node.op).vjp(g, ins, out, node.attrs)
        return [None if d is None else np.asarray(d, dtype=x.dtype) for d, x in zip(grads, ins)]


class ClosureExecutor:
    """Runs a graph node by node. `timings`, when a dict, collects wall time
    per node (for explain --analyze)."""

    path = "closures"

    def __init__(self, graph: Graph, kernels=None):
        self.graph = graph
        self.kernels = kernels or NumpyKernels()
        self.timings: dict[int, list[float]] | None = None
        self._differentiated: dict[tuple, frozenset] = {}

    def forward(self, feeds: dict[str, np.ndarray], params: dict[str, np.ndarray], roots) -> tuple[dict, list]:
        """Evaluate what `roots` need. Returns (values by node id, tape)."""
        g = self.graph
        values: dict[int, np.ndarray] = {}
        tape: list[tuple[Node, Callable]] = []
        for node in g.needed_for(roots):
            if node.op == "input":
                values[node.id] = feeds[node.name]
            elif node.op == "param":
                values[node.id] = params[node.name]
            elif node.op == "const":
                values[node.id] = np.asarray(node.attrs["value"], dtype=NUMPY_DTYPE[node.dtype])
            else:
                ins = [values[i] for i in node.inputs]
                check_index_inputs(self.graph, node, ins)
                t0 = time.perf_counter()
                out = at_node(node, lambda: self.kernels.forward(node, ins))
                self._time(node, t0)
                if np.shape(out) != node.shape:
                    raise FlowError(f"{node.op}: forward gave shape {list(np.shape(out))}, but the node is "
                                    f"{node.type}", node.span)
                values[node.id] = out
                tape.append((node, self._closure(node, ins, out)))
        return values, tape

    def _closure(self, node, ins, out):
        def backward(g):
            return self.kernels.vjp(node, g, ins, out)
        return backward

    def differentiated(self, loss_id: int, grad_inputs: bool = False) -> frozenset:
        """The nodes whose VJP runs: those on a differentiable path from a
        param (with grad_inputs, a float input too) to the loss, the graph
        path's backward set. A node that only inputs reach needs no gradient,
        and may have no VJP at all (a user op registered without one)."""
        key = (loss_id, grad_inputs)
        if key not in self._differentiated:
            self._differentiated[key] = backward_nodes(self.graph, grad_inputs, loss_id)[0]
        return self._differentiated[key]

    def backward(self, values: dict, tape: list, loss_id: int, on_grad=None, on_final=None,
                 watch=(), seed=None, grad_inputs: bool = False) -> dict[int, np.ndarray]:
        """Gradients of values[loss_id] (a scalar) for the nodes of the tape
        that need one (`differentiated`), starting from `seed` (1 unless given: a loss scale).
        on_grad(node, g, pos, d), when given, sees each VJP result (anomaly detection).
        on_final(id, grad or None) is called for each node id in `watch` as soon
        as its gradient is final: after the VJP of the earliest node reading it."""
        loss = values[loss_id]
        start = np.ones_like(loss) if seed is None else np.asarray(seed, dtype=np.asarray(loss).dtype)
        grads: dict[int, np.ndarray] = {loss_id: start}
        final_at: dict[int, list[int]] = {}
        if on_final is not None:
            seen: set[int] = set()
            for pos, (node, _closure) in enumerate(tape):
                for i in node.inputs:
                    if i in watch and i not in seen:
                        seen.add(i)
                        final_at.setdefault(pos, []).append(i)
        needed = self.differentiated(loss_id, grad_inputs)
        for pos in reversed(range(len(tape))):
            node, closure = tape[pos]
            g = grads.pop(node.id, None)  # intermediates are freed as we go
            if g is not None and node.id in needed:
                self._vjp(node, closure, g, grads, on_grad)
            for i in final_at.get(pos, ()):
                on_final(i, grads.get(i))
        return grads

    def _vjp(self, node, closure, g, grads, on_grad):
        t0 = time.perf_counter()
        nondiff = get_op(node.op).nondiff
        for pos, (i, d) in enumerate(zip(node.inputs, at_node(node, lambda: closure(g)))):
            if d is None or pos in nondiff:
                continue
            if on_grad is not None:
                on_grad(node, g, pos, d)
            if np.shape(d) != self.graph.nodes[i].shape:
                raise FlowError(f"{node.op}: backward gave input {pos}'s gradient shape {list(np.shape(d))}, "
                                f"but that input is {self.graph.nodes[i].type}", node.span)
            # a value used twice gets the sum of both gradients
            grads[i] = grads[i] + d if i in grads else d
        self._time(node, t0, backward=True)

    def _time(self, node, t0, backward=False):
        if self.timings is not None:
            self.timings.setdefault((node.id, backward), []).append(time.perf_counter() - t0)


class ClosureSession:
    """Owns the params (numpy) and runs steps through a ClosureExecutor.
    The graph executor offers the same methods with everything resident."""

    path = "closures"
    timer = "wall clock per op"

    def __init__(self, graph: Graph, params: dict[str, np.ndarray], kernels=None, scaler=None):
        self.graph = graph
        self.executor = ClosureExecutor(graph, kernels)
        self.params = {k: v.copy() for k, v in params.items()}
        self.opt_state: dict = {}
        self.counts = Counts()
        self.scaler = scaler   # a loss_scale.LossScaler under dtype="mixed"
        self._updated_names = None

    def step(self, feeds, grads: bool = True, optimizer=None, grad_inputs: bool = False, on_grad_final=None):
        """on_grad_final(name, grad): see session.Session.step; here it is called
        during the backward, as each param's gradient becomes final."""
        # A diverging run overflows in op after op: numpy would print a
        # RuntimeWarning (file and source line) for each, ahead of the one clear
        # error the training loop or check_finite gives for the non-finite loss.
        # Every closure step (training, evals, `flowgrad run`, `explain --analyze`) runs here.
        with np.errstate(all="ignore"):
            return self._step(feeds, grads, optimizer, grad_inputs, on_grad_final)

    def _step(self, feeds, grads, optimizer, grad_inputs, on_grad_final):
        g = self.graph
        roots = g.roots()
        values, tape = self.executor.forward(feeds, self.params, roots)
        outputs = {name: values[i] for name, i in g.outputs.items()}
        loss = None if g.loss is None else values[g.loss]
        out_grads = {}
        found_inf = False
        if grads or optimizer is not None:
            trainable = g.trainable()
            names = {i: name for name, i in trainable.items()}
            told: set[int] = set()
            inv = None if self.scaler is None else self.scaler.inv_scale()

            def final(i, d):
                told.add(i)
                on_grad_final(names[i], d if inv is None or d is None else (d * inv).astype(d.dtype))

            seed = None if self.scaler is None else self.scaler.seed()
            by_id = self.executor.backward(values, tape, g.loss, on_final=final if on_grad_final else None,
                                           watch=names, seed=seed, grad_inputs=grad_inputs)
            for name, i in trainable.items():
                out_grads[name] = by_id.get(i, np.zeros_like(self.params[name]))
                if on_grad_final is not None and i not in told:
                    on_grad_final(name, out_grads[name])    # no node on the tape reads it
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
        self.executor.timings = {}
        try:
            for _ in range(steps):
                self.step(feeds, grads=grads)
            timings = self.executor.timings
        finally:
            self.executor.timings = None
        graph_nodes = self.graph.nodes
        return [(graph_nodes[i].label, "backward" if bwd else "forward", float(np.median(ts))) + ((i,) * nodes)
                for (i, bwd), ts in timings.items()]
