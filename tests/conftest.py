"""Test groups by what they need: no device, numpy, Vulkan.

Vulkan tests take the `vk_device` fixture (directly or through another
fixture), which marks them `vulkan` (`-m vulkan` / `-m "not vulkan"`). Without a device they skip on a
developer's machine, and FAIL when CI=true: CI installs lavapipe, so a missing
device there is a broken set-up, not a reason to pass.

The whole suite runs with the Khronos validation layer on
(FLOWGRAD_VK_VALIDATION=1, unless set otherwise), and any validation error
reported during a test fails that test."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("FLOWGRAD_VK_VALIDATION", "1")


def env_with_path(first) -> dict:
    """os.environ with `first` put at the head of PYTHONPATH (kept, not
    replaced: the packages may live on the PYTHONPATH, as on a device machine)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(first), os.environ.get("PYTHONPATH")]))}


def pytest_collection_modifyitems(items):
    for item in items:
        if "vk_device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vulkan)


@pytest.fixture(scope="session")
def vk_device():
    from flowgrad.exec_vulkan import select_device

    try:
        dev = select_device("vulkan")
    except Exception as e:  # noqa: BLE001 - any failure means "no device" here
        if os.environ.get("CI", "").lower() == "true":
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
