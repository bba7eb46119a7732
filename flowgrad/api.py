"""The Python API: load a model, compile it into a session, step it."""
from __future__ import annotations

import warnings
from importlib import resources
from pathlib import Path

import attrs
import numpy as np

from flowgrad import dsl
from flowgrad.errors import FlowError, FlowWarning, GraphPathRefused
from flowgrad.dtypes import COMPILE_DTYPES, NUMPY_DTYPE, dtype_of
from flowgrad.graph import LEAF_OPS, Graph
from flowgrad.initializers import init_params
from flowgrad.ops.random import RNG_INPUT, rng_feed
from flowgrad.planner import Plan, make_plan


@attrs.frozen
class StepResult:
    outputs: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]
    loss: float | None = None


class Model:
    """A parsed `.flow` program plus config overrides. Graphs are built per dtype."""

    def __init__(self, program, config: dict | None = None):
        if config is not None and not isinstance(config, dict):
            raise FlowError(f"config overrides must be a dict of key -> value, got {type(config).__name__}")
        bad = [k for k in config or {} if not isinstance(k, str)]
        if bad:
            raise FlowError(f"config override keys are names (str), got {bad[0]!r}")
        self.program = program
        self.overrides = dict(config or {})
        self.graph = dsl.build(program, self.overrides, dtype="f32")  # validates the overrides

    @property
    def name(self) -> str:
        return self.graph.name

    @property
    def config(self) -> dict:
        return dict(self.graph.config)

    def build(self, dtype: str = "f32") -> Graph:
        return self.graph if dtype == "f32" else dsl.build(self.program, self.overrides, dtype=dtype)

    def with_config(self, **overrides) -> Model:
        return Model(self.program, {**self.overrides, **overrides})

    def compile(self, device: str = "auto", dtype: str = "f32", backward: str = "auto", seed: int | None = None,
                check_finite: bool = False, loss_scale=None, fusion: bool = True):
        """dtype: "f32", "f16" (every declared-f32 tensor in f16), or "mixed"
        (f16 compute, f32 master params and optimizer state, f32 losses, and
        dynamic loss scaling). check_finite: stop at the first step with a
        non-finite loss or gradient, naming the node that produced it
        (flowgrad.anomaly). loss_scale: under "mixed", the LossScaler
        (flowgrad.training.loss_scale) to use instead of GradScaler's defaults.
        fusion=False: the graph path runs every pointwise op as its own
        dispatch (to compare with the fused chains)."""
        if not isinstance(dtype, str) or dtype not in COMPILE_DTYPES:
            raise FlowError(f"dtype must be 'f32', 'f16' or 'mixed', got {dtype!r}")
        from flowgrad.training.loss_scale import LossScaler

        if loss_scale is not None and (dtype != "mixed" or not isinstance(loss_scale, LossScaler)):
            raise FlowError("loss_scale takes a flowgrad.training.loss_scale.LossScaler, and only with "
                            f"dtype='mixed' (got {type(loss_scale).__name__} with dtype={dtype!r})")
        if not isinstance(backward, str) or backward not in ("auto", "graph", "closures"):
            raise FlowError(f"backward must be 'auto', 'graph' or 'closures', got {backward!r}")
        if seed is not None and (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)
                                 or not 0 <= seed < 2**63):
            raise FlowError(f"seed must be an int in [0, 2**63), got {seed!r}")
        graph = self.build(dtype)
        from flowgrad.host_memory import check_host_memory

        check_host_memory(graph)
        dev = open_device(device)
        plan = make_plan(graph, dev.info if dev is not None else None, backward, dtype, fusion=bool(fusion))
        if plan.path != "graph" and backward == "graph":
            raise GraphPathRefused(
                "backward='graph' was asked for, but the planner refused the graph path:\n"
                + "\n".join(f"  [{r.code}] {r.headline()}" for r in plan.refusals),
                plan.refusals,
            )
        if seed is None:
            seed = graph.config.get("seed", 0)
            if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
                raise FlowError(f"config seed must be an int in [0, 2**63), got {seed!r}")
        scaler = (loss_scale or LossScaler()) if dtype == "mixed" and graph.loss is not None else None
        sess = Session(self, graph, plan, dev, init_params(graph, seed), seed=seed, scaler=scaler)
        sess.check_finite = bool(check_finite)
        return sess


def open_device(spec: str):
    """"cpu" -> None (numpy); "auto" -> a GPU's Vulkan device, else None;
    "vulkan" -> any Vulkan device (lavapipe too); "vulkan:N" -> device N."""
    if not isinstance(spec, str):
        raise FlowError(f"device must be a string ('auto', 'cpu', 'vulkan' or 'vulkan:N'), got {spec!r}")
    if spec == "cpu":
        return None
    if spec != "auto" and not str(spec).startswith("vulkan"):
        raise FlowError(f"unknown device {spec!r}: use 'auto', 'cpu', 'vulkan' or 'vulkan:N'")
    from flowgrad.exec_vulkan import select_device

    return select_device(spec)


class Session:
    """A compiled model: params, a plan, and the executor that carries it out."""

    def __init__(self, model: Model, graph: Graph, plan: Plan, device, params: dict[str, np.ndarray],
                 seed: int = 0, scaler=None):
        self.model = model
        self.loss_scaler = scaler   # dtype="mixed": the dynamic loss scale (None otherwise)
        self.seed = seed
        # training steps taken, for the random ops' counter (see flowgrad.ops.random)
        self.train_steps = 0
        self.graph = graph
        self.plan = plan
        self.device = device
        self._warned = False
        self._index_uses = index_uses(graph)
        self._hidden = {n.name for n in graph.nodes if n.op == "input" and n.name not in graph.inputs}
        # the last optimizer step() was given (or its description, loaded from a
        # checkpoint): save_checkpoint records it
        self.optimizer = None
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
        if not isinstance(values, dict):
            raise FlowError(f"set_params takes a dict of param name -> array, got {type(values).__name__}")
        arrays = {}
        for name, value in values.items():
            if not isinstance(name, str) or name not in self.graph.params:
                raise FlowError(f"set_params: {self.graph.name} has no param {name!r}")
            want = self.graph.nodes[self.graph.params[name]].type
            arr = numeric_array(value, f"set_params: param {name!r}")
            if arr.shape != want.shape:
                raise FlowError(f"set_params: param {name!r} is {want}, got shape {list(arr.shape)}")
            arrays[name] = arr
        self.runner.set_params(arrays)

    def check_feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        g = self.graph
        if not isinstance(feeds, dict):
            raise FlowError(f"feeds must be a dict of input name -> array, got {type(feeds).__name__}")
        unknown = sorted((str(k) for k in feeds if not isinstance(k, str) or k not in g.inputs))
        if unknown:
            raise FlowError(f"feed {unknown[0]!r} is not an input of {g.name} (inputs: {', '.join(g.inputs)})")
        out = {}
        for name, nid in g.inputs.items():
            node = g.nodes[nid]
            if name not in feeds:
                raise FlowError(f"missing feed for input {name!r} ({node.type})", node.span)
            arr = numeric_array(feeds[name], f"feed {name!r}", node.span)
            if arr.shape != node.shape:
                raise FlowError(f"feed {name!r} has shape {list(arr.shape)}, but input {name} is {node.type}",
                                node.span)
            try:
                narrowed = dtype_of(arr, narrow=True)   # any float feeds a float input, any int an i32 one
            except TypeError:
                narrowed = None
            if narrowed is None or (narrowed == "i32") != (node.dtype == "i32"):
                raise FlowError(f"feed {name!r} has dtype {arr.dtype}, but input {name} is {node.type}", node.span)
            if node.dtype == "i32":
                check_int32(node, arr)
            out[name] = np.asarray(arr, dtype=NUMPY_DTYPE[node.dtype], order="C")  # ascontiguousarray would make a 0-d feed [1]
            check_indices(node, out[name], self._index_uses.get(nid, ()))
        return out

    def step(self, feeds: dict[str, np.ndarray], grads: bool = True, optimizer=None,
             grad_inputs: bool = False, train: bool | None = None, on_grad_final=None) -> StepResult:
        """Forward (and backward, and an optimizer update when given).

        train: whether this is a training step (dropout active, batch norm
        on batch statistics); by default, a step that computes gradients or
        updates is one, a forward-only step is an evaluation.

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
            from flowgrad.training.optim import Optimizer

            if not isinstance(optimizer, Optimizer):
                raise FlowError(f"optimizer must be a flowgrad optimizer (flowgrad.training.optim.SGD, Adam, ...), "
                                f"got {type(optimizer).__name__}")
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

    def _random_state(self, training: bool) -> np.ndarray:
        """[training, step, seed, 0]. A training step's counter continues from
        the optimizer's step, so a resumed run draws the masks it would have."""
        if training:
            self.train_steps = max(self.train_steps, getattr(self.runner, "opt_step", 0)) + 1
        return rng_feed(training, self.train_steps, self.seed)

    def predict(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Forward outputs for feeds of any batch size (the model is rebuilt
        with its batch config key set to the size, once per size); inputs
        only the loss reads may be left out."""
        from flowgrad.training.infer import Predictor

        if self._predictor is None:
            self._predictor = Predictor(self)
        return self._predictor(feeds)

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


def numeric_array(value, what: str, span=None) -> np.ndarray:
    """A feed or param value as an array of numbers (bool, int or float)."""
    if value is None or isinstance(value, (str, bytes, dict)):
        raise FlowError(f"{what} must be an array of numbers, got {type(value).__name__}", span)
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise FlowError(f"{what} is not an array of numbers: {e}", span) from None
    if arr.dtype.kind not in "biuf":
        raise FlowError(f"{what} must be an array of numbers, got dtype {arr.dtype}", span)
    return arr


def check_int32(node, values: np.ndarray) -> None:
    """An int feed is narrowed to i32: a value outside its range would wrap."""
    if values.dtype.itemsize <= 4 and values.dtype.kind == "i" or values.size == 0:
        return
    info = np.iinfo(np.int32)
    bad = np.flatnonzero((values < info.min) | (values > info.max))
    if bad.size:
        at = np.unravel_index(bad[0], values.shape)
        raise FlowError(f"feed {node.name!r} holds {values[at]} at {list(map(int, at))}, outside the i32 range "
                        f"({info.min}..{info.max})", node.span)


def index_uses(graph: Graph) -> dict[int, list]:
    """Inputs that ops read as indices (embedding ids, cross_entropy targets):
    input id -> [(n, user node)], each index valid in [0, n)."""
    from flowgrad.ops import get_op

    uses: dict[int, list] = {}
    for user in graph.nodes:
        bounds_of = None if user.op in LEAF_OPS else get_op(user.op).index_bounds
        if bounds_of is None:
            continue
        for pos, n in bounds_of([graph.nodes[i].type for i in user.inputs], user.attrs).items():
            if graph.nodes[user.inputs[pos]].op == "input":
                uses.setdefault(user.inputs[pos], []).append((n, user))
    return uses


def check_indices(node, values: np.ndarray, uses: list) -> None:
    """Range-check a feed used as indices on the host: a device kernel would
    read garbage or give NaN instead of raising."""
    for n, user in uses:
        ignored = values == user.attrs["ignore_index"] if "ignore_index" in user.attrs else False
        bad = np.flatnonzero(((values < 0) | (values >= n)) & np.logical_not(ignored))
        if bad.size:
            at = np.unravel_index(bad[0], values.shape)
            raise FlowError(f"feed {node.name!r} holds {values[at]} at {list(map(int, at))}, out of range for "
                            f"{user.op} at {user.span.where() if user.span else '?'} (valid: 0..{n - 1})",
                            node.span)


def load(path, config: dict | None = None) -> Model:
    """A model from a .flow file, or from the name of a model shipped with
    flowgrad (`load("mlp")`) when no such file exists."""
    path = model_file(path)
    try:
        text = path.read_bytes()
    except OSError as e:
        hint = None if path.parent != Path(".") else f"models shipped with flowgrad: {', '.join(shipped_models())}"
        raise FlowError(f"cannot read model file {str(path)!r}: {e.strerror}", hint=hint) from None
    return Model(dsl.parse(text, str(path)), config)


def model_file(path) -> Path:
    """`path` itself when it names a file, or when it has a directory part;
    else the shipped model of that name (`tiny_gpt` or `tiny_gpt.flow`), if any."""
    path = Path(path)
    if path.exists() or path.parent != Path("."):
        return path
    name = path.name if path.suffix == ".flow" else f"{path.name}.flow"
    shipped = resources.files("flowgrad").joinpath("models", name)
    return Path(str(shipped)) if shipped.is_file() else path


def shipped_models() -> list[str]:
    return sorted(f.name.removesuffix(".flow") for f in resources.files("flowgrad").joinpath("models").iterdir()
                  if f.name.endswith(".flow"))


def loads(text: str | bytes, config: dict | None = None, file: str = "<string>") -> Model:
    """A model from source text (bytes are read as UTF-8)."""
    return Model(dsl.parse(text, file), config)


__all__ = ["Model", "Session", "StepResult", "load", "loads", "dtype_of"]


def _hook(on_grad_final) -> dict:
    """The runner's keyword for it, only when asked (a runner need not know it otherwise)."""
    return {} if on_grad_final is None else {"on_grad_final": on_grad_final}
