"""Submitting a recorded command buffer and waiting for it: the device's one
fence, the faults tests inject, and a lost device marked for every later use.

A step program submits the same command buffer every step, so its submit
info is built once (Submission) and the Vulkan calls go straight to the
loader: the `vulkan` binding's wrappers convert every argument on each call,
which costs more host time than the submission itself on a tiny step. The
time spent waiting on the fence is counted in the device's stats
("fence_wait_ns"), so that a benchmark can tell host time from device time;
a step that reads back while it waits counts its short waits, not the
copies between them.

The host polls the fence for up to GPU_SPIN_US before blocking on it: a
thread woken from a blocking wait can start late, which shows on a step that
takes about a millisecond (CUDA's default wait spins too). Not on a CPU
device, where the polling core is one that runs the work.
FLOWGRAD_VK_SPIN_US=N sets the limit for every device (0: block at once)."""
from __future__ import annotations

import contextlib
import functools
import os
import time

from flowgrad.errors import DeviceError, FlowError
from flowgrad.exec_vulkan import faults
from flowgrad.exec_vulkan.instance import _VK_ERRORS, load_vulkan

FENCE_TIMEOUT_NS = 600 * 10**9
POLL_NS = 100_000    # a fence wait between two polls of the read-back: short against a step worth overlapping
SPIN_ENV = "FLOWGRAD_VK_SPIN_US"
# H200, tiny_gpt steps with Adam on the device, same call: batch 1 0.69 -> 0.63 ms, batch 32 0.99 -> 0.92
GPU_SPIN_US = 2000
VK_SUCCESS, VK_NOT_READY, VK_TIMEOUT = 0, 1, 2


class Submission:
    """One command buffer, or several run in their order as one batch, ready
    to be submitted any number of times. Each encoded command buffer begins
    with a full memory barrier (encoder.py), whose first scope holds every
    command earlier in submission order: a later buffer of the batch sees
    all that an earlier one wrote, as a later submission would."""

    def __init__(self, cmd, *more):
        vk = load_vulkan()
        self.cmd = cmd
        cmds = [cmd, *more]
        # the cdata the loader reads: kept alive as long as the submission
        self._cmds = vk.ffi.new(f"VkCommandBuffer[{len(cmds)}]", cmds)
        self._info = vk.ffi.new("VkSubmitInfo*", {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                                  "commandBufferCount": len(cmds), "pCommandBuffers": self._cmds})


def submit_and_wait(device, submission: Submission, what: str, poll=None) -> None:
    """Submit, wait for the fence, reset it. A timeout or a lost device marks
    the device lost (device.check_usable says so from then on). poll, when
    given, is called while the device works, between waits of POLL_NS on the
    fence, until it returns False: the read-back copies what the device has
    finished meanwhile. Under the device's lock, whole: the queue and the
    fence are the device's, and the fence must not take a second submission
    before the first is done."""
    with device.lock:
        _submit_and_wait(device, submission, what, poll)


def _submit_and_wait(device, submission: Submission, what: str, poll) -> None:
    device.check_usable()
    spin = spin_ns(device)
    if faults.hit("submit"):
        raise DeviceError(f"{_where(device, what)} failed: {_VK_ERRORS['VkErrorOutOfHostMemory']} at submission "
                          "(injected fault)")
    device.stats["submits"] += 1
    vk = load_vulkan()
    fences = _fence(device, what)
    _check(vk.lib.vkQueueSubmit(device.queue, 1, submission._info, fences[0]), device, what)
    deadline = time.perf_counter_ns() + FENCE_TIMEOUT_NS
    if poll is not None:
        try:
            _wait_polling(device, fences, poll, deadline)
        except BaseException:
            # the device may still write what poll reads, and the fence must be done with
            with contextlib.suppress(DeviceError):
                _wait_done(device, fences, what, deadline)
            raise
    _wait_done(device, fences, what, deadline, spin)


def _wait_polling(device, fences, poll, deadline) -> None:
    """Short fence waits with poll() between them, until poll() has nothing
    left, the fence signals or fails, or the deadline passes (the final
    wait says which)."""
    while poll():
        t0 = time.perf_counter_ns()
        result = _short_wait(device, fences, max(0, min(POLL_NS, deadline - t0)))
        t1 = time.perf_counter_ns()
        device.stats["fence_wait_ns"] += t1 - t0
        if result != VK_TIMEOUT or t1 >= deadline:
            return


def _short_wait(device, fences, timeout_ns: int) -> int:
    """One wait on the fence between polls: its VkResult."""
    return load_vulkan().lib.vkWaitForFences(device.handle, 1, fences, 1, timeout_ns)


def _wait_done(device, fences, what, deadline, spin=0) -> None:
    vk = load_vulkan()
    lib = vk.lib
    t0 = time.perf_counter_ns()
    if spin:
        end = t0 + spin
        while lib.vkGetFenceStatus(device.handle, fences[0]) == VK_NOT_READY and time.perf_counter_ns() < end:
            pass
    # returns at once when the fence signalled while polling; a lost device is its result too
    result = lib.vkWaitForFences(device.handle, 1, fences, 1, max(0, deadline - t0))
    device.stats["fence_wait_ns"] += time.perf_counter_ns() - t0
    if result == VK_SUCCESS and faults.hit("fence_timeout"):   # the work is done; pretend it was not
        result = vk.VK_TIMEOUT
    if result == vk.VK_TIMEOUT:
        # the fence may still signal later: never reuse it
        device._abandoned_fences.append(device._fence)
        device._fence = device._fence_array = None
    _check(result, device, what)
    if faults.hit("device_lost"):
        _check(vk.VK_ERROR_DEVICE_LOST, device, what)
    _check(lib.vkResetFences(device.handle, 1, fences), device, what)


def spin_ns(device) -> int:
    """How long to poll the device's fence before blocking on it."""
    setting = spin_setting()
    if setting is not None:
        return setting
    return 0 if device.info.type == "cpu" else GPU_SPIN_US * 1000


@functools.cache
def spin_setting() -> int | None:
    """FLOWGRAD_VK_SPIN_US in nanoseconds, None when unset (read once)."""
    text = os.environ.get(SPIN_ENV)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise FlowError(f"{SPIN_ENV} must be a whole number of microseconds, 0 or more, got {text!r}")
    return value * 1000


def _fence(device, what):
    """The device's fence, as the one-element array the loader takes (made on first use)."""
    if device._fence_array is None:
        vk = load_vulkan()
        created = vk.ffi.new("VkFence*")
        info = vk.ffi.new("VkFenceCreateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO})
        _check(vk.lib.vkCreateFence(device.handle, info, vk.ffi.NULL, created), device, what)
        device._fence = created[0]
        device._fence_array = vk.ffi.new("VkFence[1]", [device._fence])
    return device._fence_array


def _check(result: int, device, what: str) -> None:
    """A failed call's VkResult as the DeviceError vk_errors would give; a
    lost device or a timeout also marks the device lost."""
    if result == VK_SUCCESS:
        return
    vk = load_vulkan()
    name = vk.exception_codes[result].__name__ if result in vk.exception_codes else f"VkResult {result}"
    message = f"{_where(device, what)} failed: {_VK_ERRORS.get(name, name)}"
    if name in ("VkErrorDeviceLost", "VkTimeout"):
        message += " (injected fault)" if faults.armed() else ""
        device.lost = message
    raise DeviceError(message)


def _where(device, what: str) -> str:
    return f"{what} on {device.info.name}"
