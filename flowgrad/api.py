"""The Python API: load a model, compile it into a session, step it."""
from __future__ import annotations

import warnings
from importlib import resources
from pathlib import Path

import attrs
import numpy as np

from flowgrad import dsl
from flowgrad.errors import FlowError, FlowWarning, GraphPathRefused
from flowgrad.dtypes import NUMPY_DTYPE, dtype_of
from flowgrad.graph import LEAF_OPS, Graph
from flowgrad.initializers import init_params
from flowgrad.planner import Plan, make_plan


@attrs.frozen
class StepResult:
    outputs: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]
    loss: float | None = None


class Model:
    """A parsed `.flow` program plus config overrides. Graphs are built per dtype."""

    def __init__(self, program, config: dict | None = None):
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

    def compile(self, device: str = "auto", dtype: str = "f32", backward: str = "auto", seed: int | None = None):
        if dtype not in ("f32", "f16"):
            raise FlowError(f"dtype must be 'f32' or 'f16', got {dtype!r}")
        graph = self.build(dtype)
        dev = open_device(device)
        plan = make_plan(graph, dev.info if dev is not None else None, backward, dtype)
        if plan.path != "graph" and backward == "graph":
            raise GraphPathRefused(
                "backward='graph' was asked for, but the planner refused the graph path:\n"
                + "\n".join(f"  [{r.code}] {r.headline()}" for r in plan.refusals),
                plan.refusals,
            )
        if seed is None:
            seed = int(graph.config.get("seed", 0))
        return Session(self, graph, plan, dev, init_params(graph, seed))


def open_device(spec: str):
    """"cpu" -> None (numpy); "auto" -> a GPU's Vulkan device, else None;
    "vulkan" -> any Vulkan device (lavapipe too); "vulkan:N" -> device N."""
    if spec == "cpu":
        return None
    if spec != "auto" and not str(spec).startswith("vulkan"):
        raise FlowError(f"unknown device {spec!r}: use 'auto', 'cpu', 'vulkan' or 'vulkan:N'")
    from flowgrad.exec_vulkan import select_device

    return select_device(spec)


class Session:
    """A compiled model: params, a plan, and the executor that carries it out."""

    def __init__(self, model: Model, graph: Graph, plan: Plan, device, params: dict[str, np.ndarray]):
        self.model = model
        self.graph = graph
        self.plan = plan
        self.device = device
        self._warned = False
        self._index_uses = index_uses(graph)
        # the last optimizer step() was given (or its description, loaded from a
        # checkpoint): save_checkpoint records it
        self.optimizer = None
        self._predictor = None
        self.runner = self._make_runner(params)

    def _make_runner(self, params):
        from flowgrad.exec_closure import ClosureSession

        if self.plan.path == "graph":
            from flowgrad.exec_vulkan import GraphSession

            return GraphSession(self.graph, self.plan, self.device, params)
        kernels = None
        if self.device is not None:
            from flowgrad.exec_vulkan import VulkanKernels

            kernels = VulkanKernels(self.device)
        return ClosureSession(self.graph, params, kernels)

    @property
    def last_path(self) -> str:
        return self.plan.last_path

    @property
    def params(self) -> dict[str, np.ndarray]:
        return self.runner.get_params()

    def set_params(self, values: dict[str, np.ndarray]) -> None:
        for name, value in values.items():
            if name not in self.graph.params:
                raise FlowError(f"set_params: {self.graph.name} has no param {name!r}")
            want = self.graph.nodes[self.graph.params[name]].type
            if tuple(np.shape(value)) != want.shape:
                raise FlowError(f"set_params: param {name!r} is {want}, got shape {list(np.shape(value))}")
        self.runner.set_params(values)

    def check_feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        g = self.graph
        unknown = sorted(set(feeds) - set(g.inputs))
        if unknown:
            raise FlowError(f"feed {unknown[0]!r} is not an input of {g.name} (inputs: {', '.join(g.inputs)})")
        out = {}
        for name, nid in g.inputs.items():
            node = g.nodes[nid]
            if name not in feeds:
                raise FlowError(f"missing feed for input {name!r} ({node.type})", node.span)
            arr = np.asarray(feeds[name])
            if arr.shape != node.shape:
                raise FlowError(f"feed {name!r} has shape {list(arr.shape)}, but input {name} is {node.type}",
                                node.span)
            try:
                narrowed = dtype_of(arr, narrow=True)   # any float feeds a float input, any int an i32 one
            except TypeError:
                narrowed = None
            if narrowed is None or (narrowed == "i32") != (node.dtype == "i32"):
                raise FlowError(f"feed {name!r} has dtype {arr.dtype}, but input {name} is {node.type}", node.span)
            out[name] = np.ascontiguousarray(arr, dtype=NUMPY_DTYPE[node.dtype])
            check_indices(node, out[name], self._index_uses.get(nid, ()))
        return out

    def step(self, feeds: dict[str, np.ndarray], grads: bool = True, optimizer=None,
             grad_inputs: bool = False) -> StepResult:
        """Forward (and backward, and an optimizer update when given)."""
        if (grads or optimizer is not None) and self.graph.loss is None:
            raise FlowError(f"{self.graph.name} has no `minimize` statement, so there is nothing to "
                            "differentiate; add `minimize <scalar>` or call step(..., grads=False)")
        self._warn_fallback()
        if optimizer is not None:
            self.optimizer = optimizer
        outputs, loss, out_grads = self.runner.step(self.check_feeds(feeds), grads=grads,
                                                    optimizer=optimizer, grad_inputs=grad_inputs)
        return StepResult(outputs, out_grads, None if loss is None else float(loss))

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


def index_uses(graph: Graph) -> dict[int, list]:
    """Inputs that ops read as indices (embedding ids, cross_entropy targets):
    input id -> [(n, user node)], each index valid in [0, n)."""
    from flowgrad.ops import get_op

    uses: dict[int, list] = {}
    for user in graph.nodes:
        bounds_of = None if user.op in LEAF_OPS else get_op(user.op).index_bounds
        if bounds_of is None:
            continue
        for pos, n in bounds_of([graph.nodes[i].type for i in user.inputs]).items():
            if graph.nodes[user.inputs[pos]].op == "input":
                uses.setdefault(user.inputs[pos], []).append((n, user))
    return uses


def check_indices(node, values: np.ndarray, uses: list) -> None:
    """Range-check a feed used as indices on the host: a device kernel would
    read garbage or give NaN instead of raising."""
    for n, user in uses:
        bad = np.flatnonzero((values < 0) | (values >= n))
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
        text = path.read_text()
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


def loads(text: str, config: dict | None = None, file: str = "<string>") -> Model:
    return Model(dsl.parse(text, file), config)


__all__ = ["Model", "Session", "StepResult", "load", "loads", "dtype_of"]
