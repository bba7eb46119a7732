"""A model's objectives: its `minimize` statements, each a loss and the
params it updates (`minimize d_loss over disc`).

A training step applies them in file order: objective k's forward reads
the params as the objectives before it left them, its backward
differentiates its loss for its own params only, and its optimizer (its
own state) updates them: the alternating updates of a GAN. Each objective
runs on the graph the model's graph becomes with the params it does not
update frozen (Graph.objective_graph), so every executor, the planner and
the optimizers see an ordinary one-loss model; ObjectiveRunners holds one
runner per objective over one set of params and answers the runner API
for them all. A model with one plain `minimize` has one runner, as ever."""
from __future__ import annotations

import attrs

from flowgrad.errors import FlowError
from flowgrad.graph import Graph
from flowgrad.update_counts import Counts


@attrs.frozen
class ObjectiveCounts(Counts):
    """The counts of several objectives: the first's, as Counts, and `each`
    objective's by its name. Every objective is asked for an update each
    step, so their iterations agree; under dtype="mixed" each loss scaler
    skips its own objective's updates, so their `updates` differ."""
    each: dict = attrs.field(factory=dict, hash=False)


def objective_names(graph: Graph) -> list[str]:
    """The name of each objective, in file order (a graph given a loss
    alone, not built from a file, has one: its loss's output name)."""
    if graph.objectives:
        return [o.name for o in graph.objectives]
    if graph.loss is None:
        return []
    return [next((n for n, i in graph.outputs.items() if i == graph.loss), "loss")]


def several(graph: Graph) -> bool:
    return len(graph.objectives) > 1


def objective_graphs(graph: Graph) -> list[Graph]:
    """The graph each objective steps: the model's own for one plain
    `minimize`; one `minimize LOSS over P` steps the model with the other
    params frozen."""
    if not graph.objectives or (not several(graph) and graph.objectives[0].over is None):
        return [graph]
    return [graph.objective_graph(k) for k in range(len(graph.objectives))]


def per_objective(optimizer, graph: Graph, span=None) -> list:
    """The optimizer of each objective: one optimizer serves every objective
    (each keeps its own state), a list gives one each, in file order."""
    names = objective_names(graph) or [None]
    if not isinstance(optimizer, (list, tuple)):
        return [optimizer] * len(names)
    if len(optimizer) != len(names):
        listed = ", ".join(n for n in names if n) or "none"
        raise FlowError(f"{len(optimizer)} optimizers for {graph.name}'s {len(names)} objective"
                        f"{'s' * (len(names) != 1)} ({listed}): a list gives one optimizer per `minimize`, "
                        "in the file's order", span, hint="or give one optimizer, which serves every objective "
                                                          "(each with its own state)")
    return list(optimizer)


def describe(optimizer, graph: Graph) -> dict | None:
    """What a checkpoint records of the optimizer: its description, or with
    several objectives each objective's ({"objectives": {name: ...}}). A
    description loaded from a checkpoint (a dict) stays as it is."""
    if optimizer is None or isinstance(optimizer, dict):
        return optimizer
    if not several(graph):
        (one,) = per_objective(optimizer, graph)
        return one.describe()
    return {"objectives": {name: opt.describe() for name, opt in
                           zip(objective_names(graph), per_objective(optimizer, graph))}}


def state_names(graph: Graph, params) -> list[str]:
    """The names optimizer state may be kept under: each param's, or with
    several objectives `objective/param` (each objective keeps its own)."""
    if not several(graph):
        return list(params)
    return [f"{name}/{p}" for name in objective_names(graph) for p in params]


class ObjectiveRunners:
    """One runner per objective over one set of params (the first runner's,
    which the others share), answering the runner API: params and counts are
    the first runner's, optimizer state each runner's under `objective/param`,
    an update each objective's in turn. Session.step runs `parts` in order."""

    def __init__(self, model_graph: Graph, parts: list[tuple[str, Graph, object]]):
        self.model_graph = model_graph
        self.parts = parts   # (objective name, its graph, its runner)
        self.runners = [runner for _, _, runner in parts]

    @property
    def first(self):
        return self.runners[0]

    @property
    def path(self) -> str:
        return self.first.path

    @property
    def graph(self) -> Graph:
        """The graph the first runner runs (explain --analyze times it)."""
        return self.first.graph

    @property
    def counts(self) -> ObjectiveCounts:
        """The first objective's counts (its iterations are every one's), with each one's."""
        first = self.first.counts
        return ObjectiveCounts(first.updates, first.iterations, {name: r.counts for name, _g, r in self.parts})

    @property
    def timer(self) -> str:
        return self.first.timer

    def get_params(self, names=None):
        return self.first.get_params(names)

    def set_params(self, values) -> None:
        self.first.set_params(values)

    def get_opt_state(self):
        state = {}
        for name, _graph, runner in self.parts:
            _counts, held = runner.get_opt_state()
            state.update({f"{name}/{p}": st for p, st in held.items()})
        return self.counts, state

    def set_opt_state(self, counts, state) -> None:
        """counts: ObjectiveCounts gives each objective its own; plain Counts (a
        checkpoint that kept one count) serve every objective."""
        each = getattr(counts, "each", {})
        for name, _graph, runner in self.parts:
            own = each.get(name, counts)
            runner.set_opt_state(Counts(own.updates, own.iterations),
                                 {key.split("/", 1)[1]: st for key, st in state.items()
                                  if key.split("/", 1)[0] == name})

    def apply_update(self, optimizer, grads) -> None:
        """Each objective's update of its own params from `grads`, in file order."""
        for opt, (_name, g, runner) in zip(per_objective(optimizer, self.model_graph), self.parts):
            runner.apply_update(opt, {n: grads[n] for n in g.trainable()})

    def step_together(self, feeds, grads: bool, optimizers: list, grad_inputs: bool, hook: dict) -> list | None:
        """Every objective's step at once where the runners can (the graph
        path: one submission for them all), [(outputs, loss, gradients)] of
        each in file order; None where each must step on its own."""
        if self.path != "graph":
            return None
        from flowgrad.exec_vulkan.graph_session import step_together

        return step_together(self.runners, feeds, grads, optimizers, grad_inputs, **hook)

    def profile(self, feeds, steps: int, grads: bool = True, nodes: bool = False) -> list[tuple]:
        """The first objective's step, op by op (each objective's runs the same forward)."""
        return self.first.profile(feeds, steps, grads=grads, nodes=nodes)

    def close(self) -> None:
        for runner in reversed(self.runners):   # the first owns the params the others read
            close = getattr(runner, "close", None)
            if close is not None:
                close()
