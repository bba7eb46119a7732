"""The Python API: load a model (`load`, `loads`) and compile it into a
Session (flowgrad/session.py) on a device."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from flowgrad import dsl
from flowgrad.dsl.parser import reserved
from flowgrad.errors import FlowError
from flowgrad.graph import Graph
from flowgrad.ops import user as ops_user
from flowgrad.session import CompileOptions, Session, StepResult, checked_seed, compile_session


class Model:
    """A parsed `.flow` program plus config overrides. Graphs are built per dtype."""

    def __init__(self, program, config: dict | None = None, grads: tuple = ()):
        if config is not None and not isinstance(config, dict):
            raise FlowError(f"config overrides must be a dict of key -> value, got {type(config).__name__}")
        bad = [k for k in config or {} if not isinstance(k, str)]
        if bad:
            raise FlowError(f"config override keys are names (str), got {bad[0]!r}")
        self.program = program
        self.overrides = dict(config or {})
        self.grads = tuple(grads)   # (y, x, output name) added by grad()
        self.graph = self.build("f32", check=False)  # validates the overrides

    @property
    def name(self) -> str:
        return self.graph.name

    @property
    def config(self) -> dict:
        return dict(self.graph.config)

    def build(self, dtype: str = "f32", check: bool = True, half: str = "f16") -> Graph:
        """The graph in `dtype`; under "mixed", computing in `half` (f16 or bf16)."""
        if check and dtype == "f32":
            return self.graph
        graph = dsl.build(self.program, self.overrides, dtype=dtype, half=half)
        for y, x, name in self.grads:
            add_grad_output(graph, y, x, name)
        return graph

    def with_config(self, **overrides) -> Model:
        return Model(self.program, {**self.overrides, **overrides}, self.grads)

    def grad(self, y: str, x: str, name: str | None = None) -> Model:
        """This model with one more output: the gradient of scalar value `y`
        with respect to value `x` (an input, a param or any named value), as
        `grad(y, x)` in the model file would give it; named `name`, default
        `d<y>_d<x>`. Compile it to compute it; it may be differentiated again."""
        for what, v in (("y", y), ("x", x)):
            if not isinstance(v, str):
                raise FlowError(f"grad(): {what} names a value of the model (a str), got {type(v).__name__}")
        name = name or f"d{y}_d{x}".replace(".", "_")
        return Model(self.program, self.overrides, self.grads + ((y, x, name),))

    def compile(self, device: str = "auto", dtype: str = "f32", backward: str = "auto", seed: int | None = None,
                check_finite: bool = False, loss_scale=None, fusion: bool = True, freeze=None, memory_budget=None,
                mixed: str = "auto"):
        """dtype: "f32", "f16" (every declared-f32 tensor in f16), or "mixed"
        (16-bit compute, f32 master params and optimizer state, f32 losses).
        mixed: what dtype="mixed" computes in: "bf16" (no loss scaling: bf16
        has f32's range), "f16" (with dynamic loss scaling), or "auto" (the
        default): bf16 where the device multiplies bf16 on cooperative
        matrices, else f16 (flowgrad/mixed_choice.py). check_finite: stop at
        the first step with a non-finite loss or gradient, naming the node that produced it
        (flowgrad.anomaly). loss_scale: under "mixed" in f16, the LossScaler
        (flowgrad.loss_scale) to use instead of GradScaler's defaults.
        fusion=False: the graph path runs every pointwise op as its own
        dispatch (to compare with the fused chains). freeze: params to hold
        fixed, as names, block prefixes ("decoder.0") or globs
        (flowgrad.param_patterns): they take no gradient and no update, and
        checkpoints save and load them as the others. memory_budget: bytes
        (an int) or a size ("20GB", "512MiB") the training step's planned
        peak must fit: the backward then computes again the cheapest forward
        values it would keep (flowgrad/recompute.py), or compile fails
        naming the smallest peak reached. A session made later at another
        batch size (predict's, a short batch's) is compiled alike."""
        options = CompileOptions(dtype, backward, fusion, freeze, check_finite, loss_scale, memory_budget, mixed)
        if seed is not None:
            seed = checked_seed(seed)
        return compile_session(self, open_device(device), options, seed)


def add_grad_output(graph: Graph, y: str, x: str, name: str) -> None:
    """graph.outputs[name] = d y / d x, built by the autodiff pass."""
    from flowgrad.autodiff import gradients
    from flowgrad.binder import suggest
    from flowgrad.graph_check import check_graph

    ids = {}
    for what, v in (("y", y), ("x", x)):
        found = graph.params.get(v, graph.inputs.get(v, graph.outputs.get(v)))
        if found is None:
            found = next((n.id for n in graph.nodes if n.name == v), None)
        if found is None:
            known = [n.name for n in graph.nodes if n.name]
            raise FlowError(f"grad(): {what}={v!r} is no value of model {graph.name}{suggest(v, known)}")
        ids[what] = found
    ty, tx = graph.nodes[ids["y"]].type, graph.nodes[ids["x"]].type
    if ty.shape != () or ty.dtype == "i32":
        raise FlowError(f"grad(): y={y!r} must be a float scalar, but it is {ty}", graph.nodes[ids["y"]].span)
    if tx.dtype == "i32":
        raise FlowError(f"grad(): x={x!r} must be a float tensor, but it is {tx}", graph.nodes[ids["x"]].span)
    if name in graph.outputs:
        raise FlowError(f"grad(): model {graph.name} already has an output {name!r}; pass name=")
    (graph.outputs[name],) = gradients(graph, ids["y"], [ids["x"]])
    check_graph(graph)


def grad(model: Model, y: str, x: str, name: str | None = None) -> Model:
    """Model.grad: `model` with the gradient of y with respect to x as one more output."""
    if not isinstance(model, Model):
        raise FlowError(f"grad() takes a Model (from flowgrad.load), got {type(model).__name__}")
    return model.grad(y, x, name)


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


def register_op(name, *args, **kwargs):
    """flowgrad.ops.user.register_op (see there), refusing the language's
    keywords and constants, which a model file could never call."""
    if isinstance(name, str) and reserved(name):
        raise FlowError(f"op name {name!r} is {reserved(name)} of the .flow language: register it under "
                        "another name")
    return ops_user.register_op(name, *args, **kwargs)


__all__ = ["Model", "Session", "StepResult", "grad", "load", "loads", "open_device", "register_op"]
