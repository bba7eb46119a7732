"""A step's read-back on the host: every asked-for output and gradient
copied out of the staging buffer into one host block, handed out as views.

A fresh block costs a page fault per 4 KiB on first touch (tens of ms for a
model's gradients), so the block is reused whenever no array of the previous
step is still held; one still held keeps its values. A large copy runs in
pieces on a few threads (numpy copies without the GIL), since one core reads
host memory at a fraction of what the memory system gives several.

The step's recording copies the read-backs into staging in groups of about
GROUP_BYTES, each as soon as its sources are final (program.py), and sets
an event after each group (signal_groups): while the device runs the rest
of the step, the host polls those events and copies each finished group
into the block, so most of the read-back is on the host by the time the
step's fence signals."""
from __future__ import annotations

import functools
import math
import os
import sys

import numpy as np

from flowgrad.dtypes import DEVICE_NUMPY, host_array
from flowgrad.exec_vulkan.instance import load_vulkan, vk_errors
from flowgrad.exec_vulkan.limits import ALIGN
from flowgrad.exec_vulkan.recorder import Copy, Dispatch, Signal
from flowgrad.exec_vulkan.submit import _check

CHUNK = 8 << 20          # the largest piece one thread copies
PIECE = 1 << 20          # the smallest: below two of these a copy stays on the calling thread
# Read-back bytes per group. On the H200 the device's copies do not overlap its
# compute on the one queue, and a step slows with every place they interleave with it
# (gpt_small: a copy after each gradient's writer cost more than it saved); groups of
# 8-32 MiB keep those few while the host's copy still overlaps the step.
GROUP_BYTES = 8 << 20
# A group is signalled only where this share of the step's dispatches still follows it: the
# host's copy of the group needs device work to hide behind. On the H200, gpt_small mixed (its
# gradients then all final at the end, after one unscale of them all) returned them at
# 1.57-1.69x the Adam step with every group signalled, where a run reading back at the end gave
# 1.48x.
FOLLOWING = 1 / 16
VK_EVENT_SET, VK_EVENT_RESET = 3, 4
READ_BACK = ("read-back", "transfer")


def signal_groups(commands: list, staging, events) -> list[list]:
    """Insert a Signal of the next event of `events` after each GROUP_BYTES
    or more of copies into `staging`, in command order, where at least
    FOLLOWING of the recording's dispatches still follow it; returns each
    signalled group's staging views. The copies after the last signal are
    read once the step's fence signals."""
    at = [i for i, c in enumerate(commands) if isinstance(c, Dispatch)]
    # the last command index with enough dispatches after it
    until = at[-math.ceil(len(at) * FOLLOWING)] if at else -1
    out, groups, group, size = [], [], [], 0
    for i, c in enumerate(commands):
        out.append(c)
        if isinstance(c, Copy) and c.dst.buffer is staging:
            group.append(c.dst)
            size += c.dst.nbytes
            if size >= GROUP_BYTES and i < until:
                out.append(Signal(events, len(groups), READ_BACK))
                groups.append(group)
                group, size = [], 0
    commands[:] = out
    return groups


class ReadyEvents:
    """The events a step program's device sets as its groups of read-backs
    land in staging; the host resets them before each submission (nothing
    in flight uses them then) and polls them while the step runs."""

    def __init__(self):
        self.device = None
        self.handles: list = []

    def materialize(self, device, n: int) -> None:
        vk = load_vulkan()
        self.device = device
        with vk_errors("creating the read-back events"):
            for _ in range(n):
                self.handles.append(vk.vkCreateEvent(device.handle, vk.VkEventCreateInfo(), None))
                device.objects["event"] += 1

    def reset(self) -> None:
        lib = load_vulkan().lib
        for h in self.handles:
            _check(lib.vkResetEvent(self.device.handle, h), self.device, "resetting a read-back event")

    def is_set(self, k: int) -> bool:
        result = load_vulkan().lib.vkGetEventStatus(self.device.handle, self.handles[k])
        if result not in (VK_EVENT_SET, VK_EVENT_RESET):
            _check(result, self.device, "polling a read-back event")
        return result == VK_EVENT_SET

    def free(self) -> None:
        if self.device is None or self.device.handle is None:
            return
        vk = load_vulkan()
        for h in self.handles:
            vk.vkDestroyEvent(self.device.handle, h, None)
            self.device.objects["event"] -= 1
        self.handles.clear()


class HostBlock:
    """The read-backs of one step program, laid out once: each step hands out
    fresh views (whatever a caller did to the last ones stays theirs)."""

    def __init__(self, nbytes: int, downloads, groups=()):
        """downloads: [(name, device view, staging view)], the staging views
        regions of a buffer `nbytes` long; groups: lists of those staging
        views that the device signals as ready together, in signal order."""
        self.nbytes = nbytes
        self.regions = [(name, s.shape, s.dtype, s.offset) for name, _dev, s in downloads]
        self.block = None
        grouped = {v.offset for g in groups for v in g}
        self.groups = [_ranges(g) for g in groups]
        self.rest = _ranges([s for _n, _d, s in downloads if s.offset not in grouped])

    def start(self, staging: np.ndarray | None) -> "Reading":
        """Begin one step's read-back, out of the staging buffer's mapped memory."""
        # an array of the last step still held (each holds the block) keeps its values
        if self.regions and (self.block is None or sys.getrefcount(self.block) != _UNHELD):
            self.block = np.empty(self.nbytes, np.uint8)
        return Reading(self, staging)


class Reading:
    """One step's read-back in progress: groups copied as they are ready, then the rest."""

    def __init__(self, host: HostBlock, staging):
        self.host, self.staging = host, staging
        self.done = 0   # groups copied so far

    def poll(self, ready) -> bool:
        """Copy each next group that ready(k) says the device has written;
        True while some remain."""
        groups = self.host.groups
        while self.done < len(groups) and ready(self.done):
            copy_ranges(self.host.block, self.staging, groups[self.done])
            self.done += 1
        return self.done < len(groups)

    def finish(self) -> dict[str, np.ndarray]:
        """{name: array}, once the step's fence has signalled."""
        host = self.host
        if not host.regions:
            return {}
        copy_ranges(host.block, self.staging, [r for g in host.groups[self.done:] for r in g] + host.rest)
        block = host.block
        return {name: host_array(np.ndarray(shape, DEVICE_NUMPY[dtype], block, offset), dtype)
                for name, shape, dtype, offset in host.regions}


def _ranges(views) -> list[tuple[int, int]]:
    """The byte ranges `views` cover, neighbours (ALIGN padding apart) merged."""
    out: list[list[int]] = []
    for v in sorted(views, key=lambda v: v.offset):
        lo, hi = v.offset, v.offset + v.nbytes
        if out and lo - out[-1][1] < ALIGN:
            out[-1][1] = max(out[-1][1], hi)
        elif hi > lo:
            out.append([lo, hi])
    return [tuple(r) for r in out]


class _Probe:
    """sys.getrefcount(self.block) in HostBlock.start when nothing else holds
    the block, read the same way (what the count includes differs across
    Python versions)."""

    def __init__(self):
        self.block = object()

    def refs(self) -> int:
        return sys.getrefcount(self.block)


_UNHELD = _Probe().refs()


def copy_ranges(dst: np.ndarray, src: np.ndarray, ranges) -> None:
    """dst[lo:hi] = src[lo:hi] for each (lo, hi), in pieces on a few threads when large."""
    total = sum(hi - lo for lo, hi in ranges)
    if total < 2 * PIECE:
        for lo, hi in ranges:
            np.copyto(dst[lo:hi], src[lo:hi])
        return
    piece = max(PIECE, min(CHUNK, total // _workers()))
    pieces = [(a, min(a + piece, hi)) for lo, hi in ranges for a in range(lo, hi, piece)]
    list(_pool().map(lambda r: np.copyto(dst[r[0]:r[1]], src[r[0]:r[1]]), pieces))


def parallel_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src, in pieces on a few threads when large."""
    copy_ranges(dst, src, [(0, dst.size)])


def _workers() -> int:
    return min(8, os.cpu_count() or 1)


@functools.cache
def _pool():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=_workers(), thread_name_prefix="flowgrad-read-back")
