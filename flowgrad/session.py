"""A compiled model: `compile_session` (Model.compile's, and that of the
sessions predict and short batches make at other batch sizes) makes a
Session, which holds the params and the executor that carries out its plan,
and steps it."""
from __future__ import annotations

import copy
import functools
import threading
import warnings

import attrs
import numpy as np

from flowgrad.binder import did_you_mean
from flowgrad.dtypes import COMPILE_DTYPES
from flowgrad.errors import FlowError, FlowWarning, GraphPathRefused
from flowgrad.feeds import check_feeds, index_uses, typed_array
from flowgrad.graph import Graph
from flowgrad.host_memory import check_host_memory
from flowgrad.initializers import init_params
from flowgrad.loss_scale import LossScaler
from flowgrad.mixed_choice import MixedChoice, check_mixed, choose
from flowgrad.objectives import ObjectiveRunners, objective_graphs, objective_names, per_objective, several
from flowgrad.ops.random import RNG_INPUT, rng_feed
from flowgrad.param_patterns import freeze_params
from flowgrad.planner import Plan, make_plan
from flowgrad.recompute import parse_budget


@attrs.frozen
class CompileOptions:
    """How a model is compiled (Model.compile's arguments, checked). A session
    made at another batch size is compiled with its session's."""
    dtype: str = "f32"
    backward: str = "auto"
    fusion: bool = attrs.field(default=True, converter=bool)
    freeze: object = None   # params held fixed: names, block prefixes or globs (param_patterns)
    check_finite: bool = attrs.field(default=False, converter=bool)
    loss_scale: LossScaler | None = None   # under "mixed", instead of GradScaler's defaults
    # bytes the step's planned peak must fit, recomputing forward values in the backward (flowgrad/recompute.py)
    memory_budget: int | None = attrs.field(default=None, converter=parse_budget)
    mixed: str = "auto"   # what "mixed" computes in: bf16, f16, or auto (flowgrad/mixed_choice.py)

    def __attrs_post_init__(self):
        if not isinstance(self.dtype, str) or self.dtype not in COMPILE_DTYPES:
            raise FlowError(f"dtype must be 'f32', 'f16' or 'mixed', got {self.dtype!r}")
        check_mixed(self.mixed, self.dtype, self.loss_scale)
        if self.loss_scale is not None and (self.dtype != "mixed" or not isinstance(self.loss_scale, LossScaler)):
            raise FlowError("loss_scale takes a flowgrad.loss_scale.LossScaler, and only with "
                            f"dtype='mixed' (got {type(self.loss_scale).__name__} with dtype={self.dtype!r})")
        if not isinstance(self.backward, str) or self.backward not in ("auto", "graph", "closures"):
            raise FlowError(f"backward must be 'auto', 'graph' or 'closures', got {self.backward!r}")


def compile_session(model: Model, device, options: CompileOptions, seed: int | None = None, params=None,
                    scalers: list[LossScaler] | None = None) -> Session:
    """`model` built in the options' dtype, its params frozen as they say,
    planned for `device` (an open Vulkan device, or None for numpy) and made
    a Session: the one way a Session is made. seed: its params' and random
    ops' (default: the config's). params, scalers: a session made at another
    batch size starts from its session's params and shares its loss scalers
    (a short batch's step moves the scales); a new one initialises its params
    and, under "mixed", gives each objective a loss scaler of its own, as
    the options say (a GAN's two losses overflow at scales of their own)."""
    choice = mixed_choice(options, device)
    graph = model.build(options.dtype, half=choice.half if choice is not None else "f16")
    if options.freeze is not None:
        graph = freeze_params(graph, options.freeze)
    graphs = objective_graphs(graph)   # the graph each objective steps
    if not several(graph):   # one `minimize LOSS over P`: the other params are held fixed
        graph = graphs[0]
    check_host_memory(graph)
    # one plan per objective; the graph path only if every objective's step can take it
    plans = [make_plan(g, device.info if device is not None else None, options.backward, options.dtype,
                       fusion=options.fusion, memory_budget=options.memory_budget) for g in graphs]
    plan = next((p for p in plans if p.path != "graph"), plans[0])
    if plan.path != "graph" and options.backward == "graph":
        raise GraphPathRefused(
            "backward='graph' was asked for, but the planner refused the graph path:\n"
            + "\n".join(f"  [{r.code}] {r.headline()}" for r in plan.refusals),
            plan.refusals,
        )
    if seed is None:
        seed = checked_seed(graph.config.get("seed", 0), "config seed")
    if scalers is None and choice is not None and choice.loss_scaled and graph.loss is not None:
        first = options.loss_scale or LossScaler()   # the one given is the first objective's; the others copy it
        scalers = [first] + [copy.deepcopy(first) for _ in graphs[1:]]
    if params is None:
        params = init_params(graph, seed)
    return Session(model, graph, plan, device, params, options, seed=seed, scalers=scalers, plans=plans,
                   mixed=choice)


def mixed_choice(options: CompileOptions, device) -> MixedChoice | None:
    """What dtype="mixed" computes in on `device` (None for the other dtypes)."""
    if options.dtype != "mixed":
        return None
    return choose(options.mixed, device.info if device is not None else None, options.loss_scale)


@attrs.frozen
class StepResult:
    """outputs: the first objective's forward's. grads: each param's gradient,
    from the first objective that updates it. loss: the first objective's;
    losses: each objective's (by its name in the model), from its own forward."""
    outputs: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]
    loss: float | None = None
    losses: dict[str, float] = attrs.field(factory=dict)


def _one_at_a_time(method):
    """The method under the session's lock: from several threads, a session
    runs one call at a time, each whole (a step's params, optimizer state
    and buffers are the session's own)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class Session:
    """A compiled model: params, a plan, and the executor that carries it out.
    Safe to use from several threads: calls on one session run one at a time;
    sessions on one device share its queue one submission at a time."""

    def __init__(self, model: Model, graph: Graph, plan: Plan, device, params: dict[str, np.ndarray],
                 options: CompileOptions, seed: int = 0, scalers=None, plans: list[Plan] | None = None,
                 mixed: MixedChoice | None = None):
        self._lock = threading.RLock()
        self.model = model
        self.options = options
        self.mixed = mixed   # dtype="mixed": its 16-bit type and why (None for the other dtypes)
        # dtype="mixed" in f16: each objective's dynamic loss scale (none otherwise); loss_scaler is the first's
        self.loss_scalers = list(scalers or [])
        self.loss_scaler = self.loss_scalers[0] if self.loss_scalers else None
        self.seed = seed
        # training steps taken, for the random ops' counter (see flowgrad.ops.random)
        self.train_steps = 0
        self.rank = 0   # this process's rank in data-parallel training: its dropout masks' place
        self.first_row = 0   # the feeds' row that a predict chunk starts at: its noise's place
        # (step, seed) that evaluation steps draw their noise at instead of the session's own: a predict's
        self.eval_noise = None
        self.predicts = 0    # predict calls that drew the session's own noise (each draws anew)
        self.graph = graph
        self.plan = plan   # the step's path and why: with several objectives, the first that refused the graph
        self.plans = plans or [plan]   # each objective's
        self.device = device
        self._warned = False
        self._index_uses = index_uses(graph)
        self._hidden = {n.name for n in graph.nodes if n.op == "input" and n.name not in graph.inputs}
        # the last optimizer step() was given (or its description, loaded from a
        # checkpoint): save_checkpoint records it
        self.optimizer = None
        self._optimizers_checked: list = []   # those whose no_decay names were checked against the params
        self.check_finite = options.check_finite
        self.steps = 0            # steps that computed gradients (anomaly messages count them)
        self._predictor = None
        self.runner = self._make_runner(params)

    def _make_runner(self, params):
        if not several(self.graph):
            return self._runner_for(self.graph, self.plan, params, self.loss_scaler)
        parts = []
        scalers = self.loss_scalers or [None] * len(self.plans)
        for name, graph, plan, scaler in zip(objective_names(self.graph), objective_graphs(self.graph), self.plans,
                                             scalers):
            # every objective steps the first one's params
            runner = self._runner_for(graph, plan, params, scaler, parts[0][2] if parts else None)
            parts.append((name, graph, runner))
        return ObjectiveRunners(self.graph, parts)

    def _runner_for(self, graph: Graph, plan: Plan, params, scaler, params_of=None):
        """The runner of one objective's step, with its loss scaler; params_of: the runner whose params it steps."""
        from flowgrad.exec_closure import ClosureSession

        if self.plan.path == "graph":
            from flowgrad.exec_vulkan import GraphSession

            return GraphSession(graph, plan, self.device, params, scaler=scaler, params_of=params_of)
        kernels = None
        if self.device is not None:
            from flowgrad.exec_vulkan import VulkanKernels

            kernels = VulkanKernels(self.device)
        return ClosureSession(graph, params, kernels, scaler=scaler, params_of=params_of,
                              recompute=plan.recomputed)

    @property
    def parts(self) -> list[tuple]:
        """(objective name, the graph its step runs, its runner) of each objective, in file order."""
        if isinstance(self.runner, ObjectiveRunners):
            return self.runner.parts
        return [((objective_names(self.graph) or [None])[0], self.graph, self.runner)]

    @property
    def last_path(self) -> str:
        return self.plan.last_path

    @property
    @_one_at_a_time
    def params(self) -> dict[str, np.ndarray]:
        return self.runner.get_params()

    @_one_at_a_time
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

    @_one_at_a_time
    def step(self, feeds: dict[str, np.ndarray], grads: bool = True, optimizer=None,
             grad_inputs: bool = False, train: bool | None = None, on_grad_final=None,
             outputs=None) -> StepResult:
        """Forward (and backward, and an optimizer update when given).

        feeds: the model's batch, or fewer rows (a custom loop's short last
        batch): those run on the model built at their size, as predict's
        other sizes do, with this session's params and optimizer state.

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
        starts each all-reduce bucket from it.

        outputs: the names of the outputs the result holds (default: all). On
        the graph path only those are copied back to the host: a training
        loop that reads only the loss passes outputs=() and saves the copy of
        the logits (at GPT-2's size, 0.8 GB a step)."""
        for name, value, allowed in (("grads", grads, (bool,)), ("grad_inputs", grad_inputs, (bool,)),
                                     ("train", train, (bool, type(None)))):
            if not isinstance(value, allowed + (np.bool_,)):
                raise FlowError(f"step(): {name} must be True or False, got {value!r}")
        if (grads or optimizer is not None) and self.graph.loss is None:
            raise FlowError(f"{self.graph.name} has no `minimize` statement, so there is nothing to "
                            "differentiate; add `minimize <scalar>` or call step(..., grads=False)")
        if optimizer is not None:
            self._check_optimizer(optimizer)
        outputs = self._check_outputs(outputs)
        self._warn_fallback()
        if optimizer is not None:
            self.optimizer = optimizer
        training = grads or optimizer is not None if train is None else train
        sized = self._session_for_rows(feeds)
        if sized is not None:
            return self._step_on(sized, feeds, training, dict(grads=grads, optimizer=optimizer,
                                                               grad_inputs=grad_inputs, train=train,
                                                               on_grad_final=on_grad_final, outputs=outputs))
        feeds = self.runner_feeds(feeds, training)
        wanted = outputs
        if outputs is not None and not (grads or optimizer is not None):   # the other objectives' losses
            wanted = tuple(outputs) + tuple(objective_names(self.graph)[1:])
        got, losses, out_grads = self._step_objectives(feeds, grads, optimizer, grad_inputs, on_grad_final, wanted)
        outputs = {k: v for k, v in got.items() if outputs is None or k in outputs}
        self.steps += bool(grads or optimizer is not None)
        losses = {name: float(v) for name, v in losses.items() if name is not None and v is not None}
        loss = next(iter(losses.values()), None)
        # numpy gives a 0-d result as a scalar: results are arrays whatever their rank
        return StepResult({k: np.asarray(v) for k, v in outputs.items()},
                          {k: np.asarray(v) for k, v in out_grads.items()}, loss, losses)

    def _step_objectives(self, feeds, grads, optimizer, grad_inputs, on_grad_final, outputs=None):
        """Each objective's step, in file order, each from the params the one
        before left: (the first's outputs, {objective: its loss}, each param's
        gradient from the first objective that takes it). A step without
        gradients or update runs the first alone: its outputs hold every loss."""
        learn = grads or optimizer is not None
        parts = self.parts if learn else self.parts[:1]
        optimizers = [None] * len(parts) if optimizer is None else per_objective(optimizer, self.graph)
        check = self.check_finite and learn and self.graph.loss is not None
        results = None
        if learn and not check and isinstance(self.runner, ObjectiveRunners):
            # the graph path runs them all in one submission. A checked step runs each on its own: the
            # node that made a non-finite value is found from the params its objective started from
            results = self.runner.step_together(feeds, grads, optimizers, grad_inputs,
                                                {**_hook(on_grad_final), "outputs": outputs})
        if results is None:
            results = self._each_objective(parts, optimizers, feeds, grads, grad_inputs, on_grad_final, check,
                                           outputs)
        outputs, losses, out_grads = results[0][0], {}, {}
        for (name, _graph, _runner), (_out, loss, got) in zip(parts, results):
            losses[name] = loss
            for key, value in got.items():
                out_grads.setdefault(key, value)
        if not learn:
            losses.update({name: outputs.get(name) for name in objective_names(self.graph)[1:]})
        return outputs, losses, out_grads

    def _each_objective(self, parts, optimizers, feeds, grads, grad_inputs, on_grad_final, check,
                        outputs=None) -> list[tuple]:
        """[(outputs, loss, gradients)] of each objective's step, one after the other."""
        start = (self.runner.get_params(), self.runner.get_opt_state()) if check else None
        results = []
        for k, ((_name, graph, runner), opt) in enumerate(zip(parts, optimizers)):
            if check:
                before = start[0] if k == 0 else self.runner.get_params()
                results.append(self._checked_step(graph, runner, feeds, grads, opt, grad_inputs, on_grad_final,
                                                  start, before))
            else:
                results.append(runner.step(feeds, grads=grads, optimizer=opt, grad_inputs=grad_inputs,
                                           outputs=outputs if k == 0 else (), **_hook(on_grad_final)))
        return results

    def _session_for_rows(self, feeds):
        """The session predict builds for the feeds' row count when it is below
        the declared batch (cached: the graph path records once per size);
        None for the declared batch, or for feeds check_feeds will refuse."""
        from flowgrad.training.infer import batch_size, rows_of

        b, inputs = batch_size(self.graph), self.graph.inputs
        if b is None or not isinstance(feeds, dict) or set(feeds) != set(inputs) or any(
                np.ndim(v) != len(self.graph.nodes[inputs[k]].shape) for k, v in feeds.items()):
            return None
        if any(np.shape(v)[0] >= b for k, v in feeds.items() if self.graph.nodes[inputs[k]].shape):
            return None   # not a short batch: check_feeds says what is wrong
        n = rows_of(self.graph, feeds)
        if n == 0:
            raise FlowError(f"feeds have no rows ({self.graph.name} steps on 1 to {b} rows)")
        return self._predictor_for().session_for(n)

    def compiled_like(self, model: Model) -> Session:
        """`model` (this session's at another batch size) compiled as this one
        was, on its device, from its params, seed and loss scalers."""
        return compile_session(model, self.device, self.options, self.seed, self.params, self.loss_scalers or None)

    def _step_on(self, sized, feeds, training: bool, kwargs: dict) -> StepResult:
        """A step of fewer rows than the batch, on `sized` (the model built at
        that size) with this session's params, optimizer state and random
        counter: they go there before the step and come back after it (a copy
        each way, on the device, too)."""
        sized.runner.set_params(self.runner.get_params())
        sized.runner.set_opt_state(*self.runner.get_opt_state())
        sized.seed, sized.rank, sized.train_steps, sized.steps = self.seed, self.rank, self.train_steps, self.steps
        sized.check_finite, sized._warned = self.check_finite, True   # this session warns of a fallback
        result = sized.step(feeds, **kwargs)
        if training or kwargs["optimizer"] is not None:   # a training step moves batch norm's statistics too
            self.runner.set_params(sized.runner.get_params())
        if kwargs["optimizer"] is not None:
            self.runner.set_opt_state(*sized.runner.get_opt_state())
        self.train_steps, self.steps = sized.train_steps, sized.steps
        return result

    @_one_at_a_time
    def apply_update(self, optimizer, grads: dict[str, np.ndarray]) -> None:
        """One optimizer update from the given gradients (every trainable
        param's), as step(..., optimizer=) would make from its own: for
        gradients changed on the host, accumulated over steps, or averaged
        across ranks. Under dtype="mixed", a non-finite one skips the update
        and halves the loss scale; the call is an iteration of the lr
        schedule all the same, as a step(..., optimizer=) is. With several
        objectives, each updates its own params in turn (optimizer: one for
        all, or a list of one each)."""
        self._check_optimizer(optimizer)
        trainable = [name for _, graph, _ in self.parts for name in graph.trainable()]
        arrays = self._per_param("apply_update", grads, trainable=True)
        missing = [name for name in trainable if name not in arrays]
        if missing:
            raise FlowError(f"apply_update: no gradient for param {missing[0]!r} (it needs one for every "
                            f"trainable param: {', '.join(dict.fromkeys(trainable))})")
        self.optimizer = optimizer
        self.runner.apply_update(optimizer if several(self.graph) else per_objective(optimizer, self.graph)[0],
                                 arrays)

    def _check_optimizer(self, optimizer) -> None:
        """A flowgrad optimizer (or a list of one per objective) whose schedule runs
        and whose no_decay patterns each name a param of this model (checked once
        per optimizer object)."""
        from flowgrad.param_patterns import declared_params

        for one in per_objective(optimizer, self.graph):
            _check_optimizer(one, self.runner.counts.iterations + 1)
            if not any(o is one for o in self._optimizers_checked):
                one.check_params(declared_params(self.graph), self.graph.name)
                self._optimizers_checked.append(one)

    def _check_outputs(self, outputs) -> tuple | None:
        """step's outputs= as a tuple of the model's output names (None: all)."""
        if outputs is None:
            return None
        names = tuple(outputs) if isinstance(outputs, (list, tuple, set, frozenset)) else None
        if names is None or not all(isinstance(n, str) for n in names):
            raise FlowError(f"step(): outputs must be a list of output names (or None for all), got {outputs!r}")
        for name in names:
            if name not in self.graph.outputs:
                raise FlowError(f"step(): {name!r} is not an output of {self.graph.name} "
                                f"(outputs: {', '.join(self.graph.outputs) or 'none'})",
                                hint=did_you_mean(name, self.graph.outputs))
        return names

    def _checked_step(self, graph, runner, feeds, grads, optimizer, grad_inputs, on_grad_final, start, before):
        """One objective's step, its loss and gradients read back and checked; on a
        non-finite one, the session's params and optimizer state go back to `start`
        (where the step began) and the error names the node that produced it, found
        by re-running the objective's step from `before` (the params it started from)."""
        from flowgrad import anomaly

        outputs, loss, out_grads = runner.step(feeds, grads=True, optimizer=optimizer, grad_inputs=grad_inputs,
                                               **_hook(on_grad_final))
        scaler = runner.scaler   # the objective's own
        overflow = (scaler is not None and optimizer is not None and scaler.last_skipped
                    and np.isfinite(loss))   # the loss scaler skipped the step: no anomaly
        if overflow or anomaly.step_is_finite(loss, out_grads):
            return outputs, loss, out_grads if grads else {}
        self.runner.set_params(start[0])
        self.runner.set_opt_state(*start[1])
        kernels = None
        if self.device is not None:
            from flowgrad.exec_vulkan import VulkanKernels

            kernels = VulkanKernels(self.device)
        where = anomaly.locate(graph, feeds, before, kernels)
        raise anomaly.anomaly_error(graph, self.steps + 1, loss, out_grads, where)

    @_one_at_a_time
    def close(self) -> None:
        """Free the session's device memory now (not when it is collected),
        the sessions predict made at other batch sizes' too; the session
        can't step afterwards. Closing a closed session does nothing."""
        if isinstance(self.runner, ClosedRunner):
            return
        if self._predictor is not None:
            self._predictor.close()
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
        step, seed = (self.train_steps, self.seed) if training or self.eval_noise is None else self.eval_noise
        return rng_feed(training, step, seed, self.rank, self.first_row)

    @_one_at_a_time
    def predict(self, feeds: dict[str, np.ndarray], outputs=None, seed: int | None = None) -> dict[str, np.ndarray]:
        """Forward outputs for feeds of any batch size (the model is rebuilt
        with its batch config key set to the size, once per size); inputs
        only the loss reads may be left out. outputs: the names to compute
        (default all); inputs none of them reads may then be left out too.

        Random ops: dropout is the identity; randn_like draws fresh noise on
        every call, as torch.randn_like does, from the session's seed and the
        count of its predict calls (so a session seeded alike draws the same
        sequence). seed=k draws the noise of the first predict of a session
        seeded k, whatever came before, and leaves the session's count as it was."""
        from flowgrad.ops.random import predict_noise

        if seed is None:
            out = self._predict_at(feeds, outputs, predict_noise(self.seed, self.predicts + 1))
            self.predicts += 1
            return out
        return self._predict_at(feeds, outputs, predict_noise(checked_seed(seed, "predict(): seed"), 1))

    @_one_at_a_time
    def eval_rows(self, feeds: dict[str, np.ndarray], outputs=None) -> dict[str, np.ndarray]:
        """predict, with the noise an evaluation step draws now: the training
        loop's evaluation of a short last batch, which must draw as its other
        batches do."""
        return self._predict_at(feeds, outputs, (self.train_steps, self.seed))

    def _predict_at(self, feeds, outputs, noise: tuple[int, int]) -> dict[str, np.ndarray]:
        return self._predictor_for()(feeds, outputs, noise)

    def _predictor_for(self):
        """The sessions of this model at other batch sizes (training.infer.Predictor)."""
        from flowgrad.training.infer import Predictor

        if self._predictor is None:
            self._predictor = Predictor(self)
        return self._predictor

    @_one_at_a_time
    def to_onnx(self, path, outputs: list[str] | None = None, dynamic_batch: bool = True) -> list[str]:
        """Write the forward graph with the current params as an ONNX model
        (needs the onnx package), its batch axis symbolic unless
        dynamic_batch=False; returns the exported output names."""
        from flowgrad.export_onnx import export

        return export(self, path, outputs, dynamic_batch)

    def _warn_fallback(self):
        if self._warned or self.plan.path == "graph" or self.plan.backward == "closures":
            return
        self._warned = True
        if self.plan.device is not None:
            listed = "\n".join(f"  [{r.code}] {r.headline()}" for r in self.plan.refusals)
            warnings.warn(f"{self.graph.name}: backward falls back to closures:\n{listed}", FlowWarning,
                          stacklevel=4)   # the caller of step, past its lock

    @_one_at_a_time
    def save_checkpoint(self, path) -> None:
        """Params and optimizer state to a safetensors file (atomically)."""
        from flowgrad.training.checkpoint import save_session

        save_session(self, path)

    @_one_at_a_time
    def load_checkpoint(self, path):
        """Load params (and optimizer state) saved by save_checkpoint or
        `flowgrad train`; a mismatch with this model is a FlowError listing each."""
        from flowgrad.training.checkpoint import load_into_session

        return load_into_session(self, path)

    @_one_at_a_time
    def explain(self, analyze: bool = False):
        from flowgrad.explain import explain

        return explain(self, analyze=analyze)


class ClosedRunner:
    def __getattr__(self, name):
        raise FlowError("this session is closed; compile the model again to step it")


def checked_seed(seed, what: str = "seed") -> int:
    """An int seed in [0, 2**63) (numpy ints too), else a FlowError naming `what`."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, (bool, np.bool_)) or not 0 <= seed < 2**63:
        raise FlowError(f"{what} must be an int in [0, 2**63), got {seed!r}")
    return int(seed)


def _check_optimizer(optimizer, iteration: int) -> None:
    from flowgrad.training.optim import Optimizer

    if not isinstance(optimizer, Optimizer):
        raise FlowError(f"optimizer must be a flowgrad optimizer (flowgrad.training.optim.SGD, Adam, ...), "
                        f"got {type(optimizer).__name__}")
    optimizer.lr_at(iteration)   # a schedule it cannot compute is an error before the step changes anything


def _hook(on_grad_final) -> dict:
    """The runner's keyword for it, only when asked (a runner need not know it otherwise)."""
    return {} if on_grad_final is None else {"on_grad_final": on_grad_final}
