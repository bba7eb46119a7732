"""Test groups by what they need: no device, numpy, Vulkan.

Vulkan tests take the `vk_device` fixture (directly or through another
fixture) or a parameter naming a Vulkan path ("vulkan...", "graph"), which
marks them `vulkan` (`-m vulkan` / `-m "not vulkan"`). Without a device they skip on a
developer's machine, and FAIL when CI=true: CI installs lavapipe, so a missing
device there is a broken set-up, not a reason to pass.

The whole suite runs with the Khronos validation layer on
(FLOWGRAD_VK_VALIDATION=1, unless set otherwise), and any validation error
reported during a test fails that test.

An optional module (torch, onnx, ...) is taken with `needs_module`, which
skips without it on a developer's machine and FAILS when CI=true, where
`./dev.sh test` installs every one: under CI a test skips only for a missing
device capability (no f16, no cooperative matrices), and says which."""
from __future__ import annotations

import importlib
import os

import pytest

os.environ.setdefault("FLOWGRAD_VK_VALIDATION", "1")


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


# what installs each optional module the tests take
INSTALL = {
    "torch": "pip install 'flowgrad[torch]'",
    "onnx": "pip install 'flowgrad[onnx]'",
    "onnxruntime": "pip install 'flowgrad[onnx]'",
    "tokenizers": "pip install 'flowgrad[bpe]'",
    "matplotlib": "pip install 'flowgrad[plot]'",
    "vulkan": "pip install vulkan (a dependency of flowgrad)",
}


def needs_module(name: str):
    """The module `name`, imported; if it is not installed, the test (or, at a
    module's top, the whole file) skips, saying what installs it, or fails
    when CI=true. Only a missing module counts: one that fails to import
    otherwise is an error either way."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or name != e.name and not name.startswith(e.name + "."):
            raise   # the module is there, something it imports is not
        why = f"{name} is not installed: {INSTALL.get(name, f'pip install {name}')}"
        if under_ci():
            pytest.fail(f"CI=true but {why}", pytrace=False)
        pytest.skip(why, allow_module_level=True)


def env_with_path(first) -> dict:
    """os.environ with `first` put at the head of PYTHONPATH (kept, not
    replaced: the packages may live on the PYTHONPATH, as on a device machine)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(first), os.environ.get("PYTHONPATH")]))}


def names_vulkan(value) -> bool:
    """Whether a test's parameter picks a Vulkan path: "vulkan", "vulkan:N", "vulkan-graph",
    "graph" (which only Vulkan runs), or a tuple holding one."""
    if isinstance(value, str):
        return value == "graph" or value.startswith("vulkan")
    return isinstance(value, tuple) and any(names_vulkan(v) for v in value)


def pytest_collection_modifyitems(items):
    # a test whose fixture reaches vk_device only at run time (request.getfixturevalue, for its
    # Vulkan parameters) is marked by those parameters, so that `-m vulkan` on a GPU runs it too
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "vk_device" in getattr(item, "fixturenames", ()) or any(map(names_vulkan, params.values())):
            item.add_marker(pytest.mark.vulkan)


@pytest.fixture(scope="session")
def vk_device():
    from flowgrad.exec_vulkan import select_device

    try:
        dev = select_device("vulkan")
    except Exception as e:  # noqa: BLE001 - any failure means "no device" here
        if under_ci():
            pytest.fail(f"CI=true but no Vulkan device could be opened: {e}")
        pytest.skip(f"no Vulkan device: {e}")
    return dev


@pytest.fixture(autouse=True)
def _no_validation_errors():
    from flowgrad.exec_vulkan import runtime

    runtime.clear_validation_messages()
    yield
    errors = runtime.validation_errors()
    runtime.clear_validation_messages()
    if errors:
        pytest.fail(f"{len(errors)} Vulkan validation error(s); first: {errors[0]}", pytrace=False)


@pytest.fixture(autouse=True)
def _restore_op_registry():
    """Ops registered from Python by a test (fg.register_op) stay in that test."""
    from flowgrad.ops import OPS

    saved = dict(OPS)
    yield
    OPS.clear()
    OPS.update(saved)


@pytest.fixture
def scalar_kernels(monkeypatch):
    """The kernels that move an element at a time where 16-byte vector ones exist (norm, fused_map,
    cast_f16_multi, adam_multi): for tests of those kernels' own dispatches, which devices without
    16-byte aligned bindings still run; tests/test_vector_kernels.py tests the vector ones."""
    from flowgrad.exec_vulkan import multi_tensor, optim_records
    from flowgrad.exec_vulkan.lower import fused, norm

    for module, flag in ((norm, "VECTOR_ROWS"), (fused, "VECTOR_MAPS"), (multi_tensor, "VECTOR_CASTS"),
                         (optim_records, "VECTOR_ADAM")):
        monkeypatch.setattr(module, flag, False)
