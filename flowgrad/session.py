"""A compiled model: `Model.compile` makes a Session, which holds the params
and the executor that carries out its plan, and steps it."""
from __future__ import annotations

import warnings

import attrs
import numpy as np

from flowgrad.errors import FlowError, FlowWarning
from flowgrad.feeds import check_feeds, index_uses, typed_array
from flowgrad.graph import Graph
from flowgrad.ops.random import RNG_INPUT, rng_feed
from flowgrad.planner import Plan


@attrs.frozen
class StepResult:
    outputs: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]
    loss: float | None = None


class Session:
    """A compiled model: params, a plan, and the executor that carries it out."""

    def __init__(self, model: Model, graph: Graph, plan: Plan, device, params: dict[str, np.ndarray],
                 seed: int = 0, scaler=None):
        self.model = model
        self.loss_scaler = scaler   # dtype="mixed": the dynamic loss scale (None otherwise)
        self.seed = seed
        # training steps taken, for the random ops' counter (see flowgrad.ops.random)
        self.train_steps = 0
        self.rank = 0   # this process's rank in data-parallel training: its dropout masks' place
        self.first_row = 0   # the feeds' row that a predict chunk starts at: its noise's place
        self.graph = graph
        self.plan = plan
        self.device = device
        self._warned = False
        self._index_uses = index_uses(graph)
        self._hidden = {n.name for n in graph.nodes if n.op == "input" and n.name not in graph.inputs}
        # the last optimizer step() was given (or its description, loaded from a
        # checkpoint): save_checkpoint records it
        self.optimizer = None
        self._optimizers_checked: list = []   # those whose no_decay names were checked against the params
        self.check_finite = False
        self.steps = 0            # steps that computed gradients (anomaly messages count them)
        self._predictor = None
        self.runner = self._make_runner(params)

    def _make_runner(self, params):
        from flowgrad.exec_closure import ClosureSession

        if self.plan.path == "graph":
            from flowgrad.exec_vulkan import GraphSession

            return GraphSession(self.graph, self.plan, self.device, params, scaler=self.loss_scaler)
        kernels = None
        if self.device is not None:
            from flowgrad.exec_vulkan import VulkanKernels

            kernels = VulkanKernels(self.device)
        return ClosureSession(self.graph, params, kernels, scaler=self.loss_scaler)

    @property
    def last_path(self) -> str:
        return self.plan.last_path

    @property
    def params(self) -> dict[str, np.ndarray]:
        return self.runner.get_params()

    def set_params(self, values: dict[str, np.ndarray]) -> None:
        self.runner.set_params(self._per_param("set_params", values))

    def _per_param(self, what: str, values, trainable: bool = False) -> dict[str, np.ndarray]:
        """values (a dict of param name -> array) checked against the params
        (the trainable ones only, if asked), each as an array of its type."""
        if not isinstance(values, dict):
            raise FlowError(f"{what} takes a dict of param name -> array, got {type(values).__name__}")
        names = self.graph.trainable() if trainable else self.graph.params
        arrays = {}
        for name, value in values.items():
            if trainable and isinstance(name, str) and name in self.graph.frozen:
                raise FlowError(f"{what}: param {name!r} of {self.graph.name} is frozen: it takes no gradient "
                                "and no update")
            if not isinstance(name, str) or name not in names:
                raise FlowError(f"{what}: {self.graph.name} has no {'trainable ' * trainable}param {name!r}")
            node = self.graph.nodes[self.graph.params[name]]
            arrays[name] = typed_array(value, f"{what}: param {name!r}", f"param {name}", node)
        return arrays

    def check_feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The feeds as the graph's inputs take them (see feeds.check_feeds)."""
        return check_feeds(self.graph, feeds, self._index_uses)

    def step(self, feeds: dict[str, np.ndarray], grads: bool = True, optimizer=None,
             grad_inputs: bool = False, train: bool | None = None, on_grad_final=None) -> StepResult:
        """Forward (and backward, and an optimizer update when given).

        train: whether this is a training step (dropout active, batch norm
        on batch statistics); by default, a step that computes gradients or
        updates is one, a forward-only step is an evaluation.

        optimizer: each step given one is an iteration of its lr schedule, an
        update the loss scaler skips (dtype="mixed") included, as a torch
        scheduler stepped every iteration; Adam's bias correction counts the
        updates applied (see update_counts.Counts). apply_update counts alike.

        on_grad_final(name, grad): called once for each trainable param, as
        soon as its gradient is final: during the backward on closures (in
        reverse topological order; grad is None for a param no gradient
        reaches), after the step on the graph path. Data-parallel training
        starts each all-reduce bucket from it."""
        for name, value, allowed in (("grads", grads, (bool,)), ("grad_inputs", grad_inputs, (bool,)),
                                     ("train", train, (bool, type(None)))):
            if not isinstance(value, allowed + (np.bool_,)):
                raise FlowError(f"step(): {name} must be True or False, got {value!r}")
        if (grads or optimizer is not None) and self.graph.loss is None:
            raise FlowError(f"{self.graph.name} has no `minimize` statement, so there is nothing to "
                            "differentiate; add `minimize <scalar>` or call step(..., grads=False)")
        if optimizer is not None:
            self._check_optimizer(optimizer)
        self._warn_fallback()
        if optimizer is not None:
            self.optimizer = optimizer
        feeds = self.runner_feeds(feeds, grads or optimizer is not None if train is None else train)
        if self.check_finite and self.graph.loss is not None and (grads or optimizer is not None):
            outputs, loss, out_grads = self._checked_step(feeds, grads, optimizer, grad_inputs, on_grad_final)
        else:
            outputs, loss, out_grads = self.runner.step(feeds, grads=grads, optimizer=optimizer,
                                                        grad_inputs=grad_inputs, **_hook(on_grad_final))
        self.steps += bool(grads or optimizer is not None)
        # numpy gives a 0-d result as a scalar: results are arrays whatever their rank
        return StepResult({k: np.asarray(v) for k, v in outputs.items()},
                          {k: np.asarray(v) for k, v in out_grads.items()}, None if loss is None else float(loss))

    def apply_update(self, optimizer, grads: dict[str, np.ndarray]) -> None:
        """One optimizer update from the given gradients (every trainable
        param's), as step(..., optimizer=) would make from its own: for
        gradients changed on the host, accumulated over steps, or averaged
        across ranks. Under dtype="mixed", a non-finite one skips the update
        and halves the loss scale; the call is an iteration of the lr
        schedule all the same, as a step(..., optimizer=) is."""
        self._check_optimizer(optimizer)
        trainable = self.graph.trainable()
        arrays = self._per_param("apply_update", grads, trainable=True)
        missing = [name for name in trainable if name not in arrays]
        if missing:
            raise FlowError(f"apply_update: no gradient for param {missing[0]!r} (it needs one for every "
                            f"trainable param: {', '.join(trainable)})")
        self.optimizer = optimizer
        self.runner.apply_update(optimizer, arrays)

    def _check_optimizer(self, optimizer) -> None:
        """A flowgrad optimizer whose schedule runs and whose no_decay patterns
        each name a param of this model (checked once per optimizer object)."""
        _check_optimizer(optimizer)
        if not any(o is optimizer for o in self._optimizers_checked):
            from flowgrad.param_patterns import declared_params

            optimizer.check_params(declared_params(self.graph), self.graph.name)
            self._optimizers_checked.append(optimizer)

    def _checked_step(self, feeds, grads, optimizer, grad_inputs, on_grad_final=None):
        """A step whose loss and gradients are read back and checked; on a
        non-finite one, the params (and optimizer state) go back to where the
        step started and the error names the node that produced it."""
        from flowgrad import anomaly

        params, opt_state = self.runner.get_params(), self.runner.get_opt_state()
        outputs, loss, out_grads = self.runner.step(feeds, grads=True, optimizer=optimizer, grad_inputs=grad_inputs,
                                                    **_hook(on_grad_final))
        overflow = (self.loss_scaler is not None and optimizer is not None and self.loss_scaler.last_skipped
                    and np.isfinite(loss))   # the loss scaler skipped the step: no anomaly
        if overflow or anomaly.step_is_finite(loss, out_grads):
            return outputs, loss, out_grads if grads else {}
        self.runner.set_params(params)
        self.runner.set_opt_state(*opt_state)
        kernels = None
        if self.device is not None:
            from flowgrad.exec_vulkan import VulkanKernels

            kernels = VulkanKernels(self.device)
        where = anomaly.locate(self.graph, feeds, params, kernels)
        raise anomaly.anomaly_error(self.graph, self.steps + 1, loss, out_grads, where)

    def close(self) -> None:
        """Free the session's device memory now (not when it is collected);
        the session can't step afterwards."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        self.runner = ClosedRunner()

    def runner_feeds(self, feeds: dict[str, np.ndarray], training: bool) -> dict[str, np.ndarray]:
        """The checked feeds plus the inputs the session feeds itself (the
        random state), for one step of the given kind."""
        feeds = self.check_feeds(feeds)
        if RNG_INPUT in self._hidden:
            feeds[RNG_INPUT] = self._random_state(training)
        return feeds

    def eval_random_state(self) -> np.ndarray:
        """The random state an evaluation step feeds now, which its randn_like draws from."""
        return self._random_state(False)

    def _random_state(self, training: bool) -> np.ndarray:
        """[training, step, seed, rank, row]. A training step's counter continues from
        the optimizer's iterations (the run's steps, skipped ones included), so a
        resumed run draws the masks it would have."""
        if training:
            self.train_steps = max(self.train_steps, self.runner.counts.iterations) + 1
        return rng_feed(training, self.train_steps, self.seed, self.rank, self.first_row)

    def predict(self, feeds: dict[str, np.ndarray], outputs=None) -> dict[str, np.ndarray]:
        """Forward outputs for feeds of any batch size (the model is rebuilt
        with its batch config key set to the size, once per size); inputs
        only the loss reads may be left out. outputs: the names to compute
        (default all); inputs none of them reads may then be left out too."""
        from flowgrad.training.infer import Predictor

        if self._predictor is None:
            self._predictor = Predictor(self)
        return self._predictor(feeds, outputs)

    def to_onnx(self, path, outputs: list[str] | None = None) -> list[str]:
        """Write the forward graph with the current params as an ONNX model
        (needs the onnx package); returns the exported output names."""
        from flowgrad.export_onnx import export

        return export(self, path, outputs)

    def _warn_fallback(self):
        if self._warned or self.plan.path == "graph" or self.plan.backward == "closures":
            return
        self._warned = True
        if self.plan.device is not None:
            listed = "\n".join(f"  [{r.code}] {r.headline()}" for r in self.plan.refusals)
            warnings.warn(f"{self.graph.name}: backward falls back to closures:\n{listed}", FlowWarning,
                          stacklevel=3)

    def save_checkpoint(self, path) -> None:
        """Params and optimizer state to a safetensors file (atomically)."""
        from flowgrad.training.checkpoint import save_session

        save_session(self, path)

    def load_checkpoint(self, path):
        """Load params (and optimizer state) saved by save_checkpoint or
        `flowgrad train`; a mismatch with this model is a FlowError listing each."""
        from flowgrad.training.checkpoint import load_into_session

        return load_into_session(self, path)

    def explain(self, analyze: bool = False):
        from flowgrad.planner.explain import explain

        return explain(self, analyze=analyze)


class ClosedRunner:
    def __getattr__(self, name):
        raise FlowError("this session is closed; compile the model again to step it")


def _check_optimizer(optimizer) -> None:
    from flowgrad.training.optim import Optimizer

    if not isinstance(optimizer, Optimizer):
        raise FlowError(f"optimizer must be a flowgrad optimizer (flowgrad.training.optim.SGD, Adam, ...), "
                        f"got {type(optimizer).__name__}")
    optimizer.lr_at(1)   # a schedule it cannot compute is an error before the step changes anything


def _hook(on_grad_final) -> dict:
    """The runner's keyword for it, only when asked (a runner need not know it otherwise)."""
    return {} if on_grad_final is None else {"on_grad_final": on_grad_final}
