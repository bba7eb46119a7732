"""Injected Vulkan faults (flowgrad.exec_vulkan.faults): each is a
DeviceError saying what failed; after an allocation or submission failure
the session still steps, after a timeout or a lost device every use says the
device is gone; and no Vulkan object outlives its session."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import DeviceError
from flowgrad.exec_closure import ClosureSession
from flowgrad.exec_vulkan import faults
from flowgrad.planner import make_plan

pytestmark = pytest.mark.vulkan


@pytest.fixture(params=["mapped", "staging"])
def device(vk_device, request):
    """A device of its own: a test that loses it must not take the shared one
    with it. Both memory paths: mapped device buffers (unified memory), and
    staging buffers, as on a discrete GPU."""
    from flowgrad.exec_vulkan.runtime import Device

    if request.param == "mapped" and vk_device.staging:
        pytest.skip("no unified memory on this device; the staging run covers it")
    return Device(vk_device.info.index, staging=request.param == "staging")


@pytest.fixture(autouse=True, params=["after the fence", "while waiting"])
def groups(request, monkeypatch):
    """Each case with the read-back copied out after the fence, and with every
    read-back a group of its own, copied out while the host waits."""
    from flowgrad.exec_vulkan import readback

    if request.param == "while waiting":
        monkeypatch.setattr(readback, "GROUP_BYTES", 1)


def setup(device):
    model = fg.load("flowgrad/models/mlp.flow", {"batch": 4, "hidden": 8})
    graph = model.graph
    plan = make_plan(graph, device.info)
    assert plan.path == "graph", plan.last_path
    from flowgrad.initializers import init_params

    params = init_params(graph, 0)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 64)).astype(np.float32), "y": np.arange(4, dtype=np.int32)}
    want = ClosureSession(graph, params).step(feeds)
    return graph, plan, params, feeds, want


def graph_session(device, graph, plan, params):
    from flowgrad.exec_vulkan import GraphSession

    return GraphSession(graph, plan, device, params)


def same(got, want):
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4)
    for k in want[2]:
        np.testing.assert_allclose(got[2][k], want[2][k], rtol=1e-4, atol=1e-6)


def settled(device):
    """Vulkan objects in use: the pool's idle buffers (staging buffers kept
    for the next upload) are freed first, so only what something still holds counts."""
    gc.collect()
    device.pool.drain()
    return device.live_objects()


def test_every_allocation_failure_is_clean(device):
    graph, plan, params, feeds, want = setup(device)
    baseline = settled(device)
    n = 0
    while True:
        n += 1
        gs = None
        with faults.inject(alloc=n) as seen:
            try:
                gs = graph_session(device, graph, plan, params)
                gs.step(feeds)
                reached = seen["alloc"] >= n
            except DeviceError as e:
                assert "allocating" in e.message and "injected fault" in e.message, e.message
                reached = True
        if gs is not None:      # the session survived the failure: it steps now
            same(gs.step(feeds), want)
            gs.close()
        del gs
        assert settled(device) == baseline, f"allocation {n}"
        if not reached:
            break
    assert n > 3     # a graph session allocates several buffers, each failure was tried


def test_a_failed_submission_leaves_the_session_usable(device):
    graph, plan, params, feeds, want = setup(device)
    baseline = settled(device)
    gs = graph_session(device, graph, plan, params)
    with faults.inject(submit=1):
        with pytest.raises(DeviceError, match="running a graph step .* failed: .*injected fault"):
            gs.step(feeds)
    same(gs.step(feeds), want)
    gs.close()
    del gs
    assert settled(device) == baseline


@pytest.mark.parametrize("fault, words", [("fence_timeout", "timed out"), ("device_lost", "VK_ERROR_DEVICE_LOST")])
def test_a_timeout_or_lost_device_is_reported_on_every_later_use(device, fault, words):
    graph, plan, params, feeds, _want = setup(device)
    baseline = settled(device)
    gs = graph_session(device, graph, plan, params)
    gs.step(feeds)
    with faults.inject(**{fault: 1}):
        with pytest.raises(DeviceError, match=words):
            gs.step(feeds)
    with pytest.raises(DeviceError, match="can't be used any more") as e:
        gs.step(feeds)
    assert words in e.value.message
    gs.close()
    del gs
    # a timed-out fence may still signal: it is kept, never reused
    kept = {"timed-out fence": 1} if fault == "fence_timeout" else {}
    assert settled(device) == {**baseline, **kept}


def test_closures_on_vulkan_survive_a_failed_submission(device):
    from flowgrad.exec_vulkan import VulkanKernels

    graph, _plan, params, feeds, want = setup(device)
    cs = ClosureSession(graph, params, VulkanKernels(device))
    with faults.inject(submit=3):
        with pytest.raises(DeviceError, match="injected fault"):
            cs.step(feeds)
    same(cs.step(feeds), want)


def test_unknown_fault_names_are_refused():
    with pytest.raises(ValueError, match="unknown fault"):
        with faults.inject(alloc_nth=1):
            pass
