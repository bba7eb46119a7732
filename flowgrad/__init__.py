"""flowgrad: train neural networks written in the `.flow` language."""
import importlib

__version__ = "0.1.0"

# Loaded on first use (PEP 562), so `import flowgrad.ops` loads the op table
# alone, not the DSL, the planner or a backend.
_EXPORTS = {
    "Model": "flowgrad.api", "Session": "flowgrad.session", "StepResult": "flowgrad.session", "load": "flowgrad.api",
    "loads": "flowgrad.api", "DeviceError": "flowgrad.errors", "FlowError": "flowgrad.errors",
    "FlowWarning": "flowgrad.errors", "GraphPathRefused": "flowgrad.errors", "train": "flowgrad.trainer",
    "register_op": "flowgrad.api", "grad": "flowgrad.api", "ArrayData": "flowgrad.training.data", "Dataset": "flowgrad.training.data",
    "load_trained": "flowgrad.overrides",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"flowgrad.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"flowgrad.{name}":
            raise
        raise AttributeError(f"module 'flowgrad' has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
