"""What a lowering sees: BufView (a typed window into a device buffer) and the
Recorder (dispatch, fill, copy, scratch).

The Recorder only builds a list of commands, without Vulkan; `encoder.encode`
turns that list into a Vulkan command buffer. So the same lowering code runs
against a real device or a dry run without one (Recorder(device=None), used
by `explain` to count dispatches), and the executors can encode one list with
or without timestamp queries. Barriers go only where a command reads or
overwrites a byte range that an earlier command since the last barrier wrote
(or overwrites one it read): Hazards tracks that, here for counting and in the
encoder for placing them, and which stages (compute, transfer) a barrier
must wait for. A lowering may chain dispatches that read each
other's output, and independent dispatches stay free to overlap."""
from __future__ import annotations

import contextlib
import math
import struct

import attrs
import numpy as np

from flowgrad.errors import DeviceError
from flowgrad.dtypes import HALF_DTYPES, ITEMSIZE, bf16_bits
from flowgrad.exec_vulkan.buffers import BufView, LateBuffer
from flowgrad.exec_vulkan.discovery import DeviceCaps
from flowgrad.exec_vulkan.index_checks import IndexChecks
from flowgrad.exec_vulkan.limits import ALIGN, DRY_MAX_GROUPS, align_up, grid
from flowgrad.exec_vulkan.push_constants import push_spec
from flowgrad.exec_vulkan.spirv import shader_info

__all__ = ["Arena", "BufView", "Copy", "Dispatch", "FakeBuffer", "Fill", "Mark", "Recorder", "Signal", "count_barriers",
           "depends", "grid", "overlaps"]


@attrs.frozen
class Dispatch:
    shader: str
    variant: str | None
    views: tuple[BufView, ...]
    readonly: tuple[bool, ...]
    push: bytes
    groups: tuple[int, int, int]
    label: tuple | None
    spec: tuple[int, ...] = ()   # specialization constants 0, 1, ... (u32 words): one pipeline per distinct tuple
    # a tensor-core product, whose grid fills the GPU alone: it waits for the earlier ones though
    # no hazard orders them (Hazards.wait_for says why)
    alone: bool = False


@attrs.frozen
class Fill:
    view: BufView
    value: int
    label: tuple | None


@attrs.frozen
class Copy:
    src: BufView
    dst: BufView
    label: tuple | None


@attrs.frozen
class Signal:
    """Sets event `index` of `events` once the copies before it are done,
    for the host to read what they wrote while the rest runs."""
    events: object
    index: int
    label: tuple | None


@attrs.frozen
class Mark:
    """A point a later command may wait for without waiting for what comes
    between (a split barrier: the device sets an event here, and a wait on
    it covers only the commands before it). What follows a mark up to the
    next wait runs beside whatever that wait lets start: a thin product
    beside the next one."""
    label: tuple | None


class Arena(LateBuffer):
    """Scratch memory for lowerings: bump allocation in one buffer that is
    created (at its high-water size) only after recording. Each lowering
    call's scratch is released when the call returns, so calls reuse it.
    A main arena holds two more: `lasting`, for what one lowering call
    leaves for a later one (Recorder.keep), never released while the
    recording lives; and `spare`, that a section takes its scratch from when
    the last section that took any took it from the main one
    (Recorder.section): two such sections in a row share no bytes, which
    would order them (a barrier) where nothing else does."""

    what = "scratch arena"

    def __init__(self, main: bool = True):
        super().__init__()
        self.top = 0
        self.high = 0
        self.lasting = Arena(main=False) if main else None
        self.spare = Arena(main=False) if main else None

    def alloc(self, nbytes: int) -> int:
        offset = self.top
        self.top = align_up(offset + max(int(nbytes), 1))
        self.high = max(self.high, self.top)
        return offset

    @property
    def scratch_bytes(self) -> int:
        """The scratch of this arena and its spare."""
        return self.high + (self.spare.high if self.spare is not None else 0)

    def _parts(self) -> list:
        return [self] + [a for a in (self.lasting, self.spare) if a is not None]

    def materialize(self, device, pool=None) -> None:
        """Allocate the buffers: from `pool` (returned to it by free) or their own."""
        for arena in self._parts():
            arena.allocate(device, arena.high, pool)

    def free(self) -> None:
        for arena in self._parts():
            LateBuffer.free(arena)


class FakeBuffer:
    """Stands in for a device buffer in a dry run."""

    def __init__(self, nbytes: int, name: str = ""):
        self.nbytes = nbytes
        self.name = name


class Recorder:
    """Collects the commands lowerings record. device=None is a dry run: the
    same checks, no Vulkan (explain counts dispatches with it). `info` (a
    DeviceInfo) lets a dry run pick the kernels that device would run."""

    def __init__(self, device=None, arena: Arena | None = None, info=None):
        self.device = device
        self.caps = DeviceCaps.of(device.info if device is not None else info)   # what lowerings pick kernels by
        self.align = device.min_align if device is not None else ALIGN
        self.max_groups = device.max_groups if device is not None else DRY_MAX_GROUPS
        self.commands: list = []
        self.arena = arena or Arena()
        self._scratch = self.arena        # the arena scratch comes from now (section)
        self._took: Arena | None = None   # the one the last section that took scratch took it from
        self.checks = IndexChecks()
        self.trusted: frozenset = frozenset()   # node ids whose indices the host range-checks (feeds)
        self.label: tuple | None = None
        self._kept: dict = {}
        self._counters = 0

    # -- the lowering API

    def dispatch(self, shader: str, bufs, push=(), groups=(1, 1, 1), variant: str | None = None,
                 spec: tuple = (), alone: bool = False) -> None:
        info = shader_info(shader, variant)
        bufs = list(bufs)
        if len(bufs) != info.bindings:
            raise DeviceError(f"shader {info.name} has {info.bindings} buffer bindings, but the dispatch passed "
                              f"{len(bufs)} buffers")
        limit = self.device.max_storage_range if self.device is not None else None
        for i, b in enumerate(bufs):
            if not isinstance(b, BufView):
                raise DeviceError(f"dispatch of {info.name}: buffer {i} is a {type(b).__name__}, not a BufView")
            if limit is not None and b.nbytes > limit:
                raise DeviceError(f"dispatch of {info.name}: buffer {i} is {b.nbytes} bytes, more than one shader "
                                  f"binding may address on {self.device.info.name} ({limit} bytes)",
                                  hint="use a smaller batch or model")
        groups = tuple(int(g) for g in groups) + (1,) * (3 - len(groups))
        if len(groups) != 3 or any(g < 0 or g > m for g, m in zip(groups, self.max_groups)):
            raise DeviceError(f"dispatch of {info.name}: group counts {groups} exceed the device's limit "
                              f"{self.max_groups}; use recorder.grid(n) for long 1-D launches")
        packed = push_spec(shader).pack(push)   # checked against the shader's declared block
        # a view whose offset the device cannot bind goes through an aligned scratch copy
        moved = []
        for i, b in enumerate(bufs):
            if b.offset % self.align:
                tmp = self.scratch(b.shape, b.dtype)
                self.copy(b, tmp)
                moved.append((i, b, tmp))
                bufs[i] = tmp
        self.commands.append(Dispatch(shader, variant, tuple(bufs), info.readonly, packed, groups, self.label,
                                      tuple(int(w) & 0xFFFFFFFF for w in spec), alone))
        for i, original, tmp in moved:
            if not info.readonly[i]:
                self.copy(tmp, original)

    def fill_value(self, view: BufView, value: float) -> None:
        """Set every element of `view` (f32, f16 or i32) to `value`."""
        self.fill(view, fill_word(value, view.dtype))

    def fill(self, view: BufView, value: int = 0) -> None:
        """Set every 32-bit word of `view` to `value` (vkCmdFillBuffer). An f16
        view with half-word ends takes value's low 16 bits for those ends, so
        the value must repeat per half word (0 does)."""
        value = int(value) & 0xFFFFFFFF
        lo, hi = view.offset, view.offset + view.nbytes
        a, b = align_up(lo, 4), hi // 4 * 4
        if a < b:
            self.commands.append(Fill(BufView(view.buffer, a, ((b - a) // 4,), "i32"), value, self.label))
        ends = sorted({x for x, odd in ((lo, lo % 4), (hi - 2, hi % 4)) if odd and lo < hi})
        for start in ends:
            if (value & 0xFFFF) != (value >> 16):
                raise DeviceError(f"fill of an f16 view with half-word ends needs a value that repeats per half "
                                  f"word, got {value:#x}")
            self._fill_half_word(view.buffer, start, value)

    def _fill_half_word(self, buffer, byte_offset: int, value: int) -> None:
        word = byte_offset // 4
        base = word * 4 // self.align * self.align      # a bindable offset at or below the word
        keep = 0xFFFF0000 if byte_offset % 4 == 0 else 0x0000FFFF
        window = BufView(buffer, base, ((word * 4 - base) // 4 + 1,), "i32")
        push = push_spec("fill_word").pack([(word * 4 - base) // 4, keep, value])
        self.commands.append(Dispatch("fill_word", None, (window,), (False,), push, (1, 1, 1), self.label))

    def copy(self, src: BufView, dst: BufView) -> None:
        if src.nbytes != dst.nbytes:
            raise DeviceError(f"copy of {src.nbytes} bytes into a {dst.nbytes}-byte view")
        if src.nbytes:
            self.commands.append(Copy(src, dst, self.label))

    def scratch(self, shape, dtype: str) -> BufView:
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        return BufView(self._scratch, self._scratch.alloc(nbytes), shape, dtype)

    def stand_in(self, dtype: str) -> BufView:
        """A view for a binding the dispatch's mode never touches: one aligned
        word per dtype for the whole recording, which orders no command (it is
        no dependency between two dispatches that bind it)."""
        kept = self.keep(("stand-in", dtype), (1,), dtype)
        return StandIn(kept.buffer, kept.offset, kept.shape, kept.dtype)

    def keep(self, key, shape, dtype: str) -> BufView:
        """A view that outlives the lowering call: a forward leaves in it what
        its backward, recorded later into the same recording, reads back
        through kept(key). The same key gives the same view."""
        shape = tuple(int(d) for d in shape)
        if key not in self._kept:
            lasting = self.arena.lasting
            self._kept[key] = BufView(lasting, lasting.alloc(math.prod(shape) * ITEMSIZE[dtype]), shape, dtype)
        view = self._kept[key]
        if view.shape != shape or view.dtype != dtype:
            raise DeviceError(f"internal error: kept view {key!r} asked for as {dtype}{list(shape)}, "
                              f"kept as {view.dtype}{list(view.shape)}")
        return view

    def counters(self, n: int) -> BufView:
        """n 32-bit words, 0 whenever a run of this recording starts (their
        fill heads the recording, where no dispatch waits for it): how the
        pieces of a split reduction pass to the workgroup that finishes it
        within the same dispatch (the last to count), or flags a step sets."""
        self._counters += 1
        view = self.keep(("counters", self._counters), (n,), "i32")
        at = len(self.commands)
        self.fill(view, 0)
        fill = self.commands[at:]
        del self.commands[at:]
        self.commands[:0] = fill
        return view

    def kept(self, key) -> BufView | None:
        """The view keep(key, ...) made earlier in this recording, or None
        (the backward of a one-op-at-a-time run has no forward recorded
        beside it, and recomputes instead)."""
        return self._kept.get(key)

    def index_flag(self, node, pos: int, ids: BufView, bound: int) -> BufView:
        """A word for a kernel reading `ids` (input `pos` of `node`, valid
        0..bound-1) to flag the first bad one in: the executor resets it and
        reads it back, and raises for a flagged node (index_checks.py). A
        trusted input (a feed, checked on the host) gets a scratch word instead."""
        if node.inputs[pos] in self.trusted:
            return self.scratch((1,), "i32")
        return self.checks.slot(node, pos, ids, bound)

    grid = staticmethod(grid)

    # -- for executors

    @contextlib.contextmanager
    def section(self, label: str, direction: str, node: int | None = None):
        """Commands recorded inside are tagged (label, direction) for
        profiling, or (label, direction, node) for a graph node's section:
        two nodes may share a label (a rebound name), and a profile tells them
        apart by the id; scratch taken inside is released at the end. It
        comes from the other arena than the last section's that took any."""
        arena = (self.arena.spare or self.arena) if self._took is self.arena else self.arena
        saved, outer, top = self.label, self._scratch, arena.top
        self.label, self._scratch = (label, direction) if node is None else (label, direction, node), arena
        try:
            yield self
        finally:
            if arena.top != top:
                self._took = arena
            self.label, self._scratch, arena.top = saved, outer, top

    @contextlib.contextmanager
    def released(self):
        """Scratch taken inside is released at the end: what comes next takes the same bytes."""
        arena = self._scratch
        top = arena.top
        try:
            yield
        finally:
            arena.top = top

    def counts(self) -> dict:
        out = {"dispatches": 0, "fills": 0, "copies": 0}
        for c in self.commands:
            if not isinstance(c, (Signal, Mark)):
                out["dispatches" if isinstance(c, Dispatch) else "fills" if isinstance(c, Fill) else "copies"] += 1
        return out


# --------------------------------------------------------------------------- hazards


@attrs.frozen
class StandIn(BufView):
    """A bound view no thread reads or writes (Recorder.stand_in)."""


def touched(cmd):
    """(reads, writes): lists of (buffer, lo, hi) a command touches."""
    if isinstance(cmd, Dispatch):
        bound = [(v, ro) for v, ro in zip(cmd.views, cmd.readonly) if not isinstance(v, StandIn)]
        reads = [(v.buffer, v.offset, v.offset + v.nbytes) for v, _ro in bound]
        writes = [r for r, (_v, ro) in zip(reads, bound) if not ro]
        return reads, writes
    if isinstance(cmd, Fill):
        return [], [(cmd.view.buffer, cmd.view.offset, cmd.view.offset + cmd.view.nbytes)]
    if isinstance(cmd, (Signal, Mark)):
        return [], []
    return ([(cmd.src.buffer, cmd.src.offset, cmd.src.offset + cmd.src.nbytes)],
            [(cmd.dst.buffer, cmd.dst.offset, cmd.dst.offset + cmd.dst.nbytes)])


def overlaps(a, b) -> bool:
    """Two lists of touched (buffer, lo, hi) ranges share a byte."""
    return any(x[0] is y[0] and x[1] < y[2] and y[1] < x[2] for x in a for y in b)


def depends(cmd, earlier) -> bool:
    """cmd must run after `earlier`: one writes bytes the other reads or writes."""
    reads, writes = touched(cmd)
    their_reads, their_writes = touched(earlier)
    return overlaps(their_writes, reads + writes) or overlaps(their_reads, writes)


# The pipeline stage a command's accesses happen in: barriers wait only for
# the stages of the accesses a later command depends on, so a compute ->
# compute barrier does not also wait for a read-back copy still in flight.
COMPUTE, TRANSFER = 1, 2
ALL_STAGES = COMPUTE | TRANSFER


def stage_of(cmd) -> int:
    return COMPUTE if isinstance(cmd, Dispatch) else TRANSFER


class Hazards:
    """Byte ranges read and written, each with its stage and epoch (the
    number of marks before it), that no barrier has waited for yet. After a
    Mark, a command whose hazards all lie before the mark may wait on the
    mark's event alone (`early`), leaving what came after the mark running."""

    def __init__(self):
        self.reads: dict[int, list] = {}    # id(buffer) -> [(lo, hi, stage, epoch)]
        self.writes: dict[int, list] = {}
        self.alone: set[int] = set()   # epochs of the Dispatch.alone since the last compute barrier
        self.epoch = 0
        self.marked = False   # a mark since the last barrier that waited for everything
        self.beside = False   # no wait since the mark: a product here runs beside the next one
        self.early = False    # the last wait_for's hazards all lie before the mark
        self.barriers = 0

    @staticmethod
    def _hit(table, ranges) -> tuple[int, int]:
        """(stages, latest epoch) of the entries `ranges` touch."""
        stages, epoch = 0, -1
        for buf, lo, hi in ranges:
            for a, b, stage, e in table.get(id(buf), ()):
                if a < hi and lo < b:
                    stages |= stage
                    epoch = max(epoch, e)
        return stages, epoch

    def wait_for(self, cmd) -> int:
        """The stages whose earlier accesses `cmd` must wait for (0: none);
        `early` says whether the last mark's event covers them."""
        reads, writes = touched(cmd)
        hits = [self._hit(self.writes, reads), self._hit(self.writes, writes), self._hit(self.reads, writes)]
        stages = hits[0][0] | hits[1][0] | hits[2][0]
        latest = max(e for _s, e in hits)
        # Two tensor-core products side by side (a layer's dX and dW, both reading dY) contend
        # for the GPU that each fills alone: one after the other made GPT-2's mixed step 2.6%
        # faster on an H100. Other kernels stay free to overlap (ordering every f32 product
        # cost its step 3.4%). A product between a mark and the next wait is one put there
        # to run beside the next product, and holds none back (note)
        if isinstance(cmd, Dispatch) and cmd.alone and self.alone:
            stages |= COMPUTE
            latest = max(latest, *self.alone)
        self.early = bool(stages) and self.marked and latest < self.epoch
        return stages

    def note(self, cmd) -> None:
        if isinstance(cmd, Mark):
            self.epoch += 1
            self.marked = self.beside = True
            return
        reads, writes = touched(cmd)
        stage = stage_of(cmd)
        if isinstance(cmd, Dispatch) and cmd.alone and not self.beside:
            self.alone.add(self.epoch)
        for table, ranges in ((self.reads, reads), (self.writes, writes)):
            for buf, lo, hi in ranges:
                table.setdefault(id(buf), []).append((lo, hi, stage, self.epoch))

    def clear(self, stages: int = ALL_STAGES, early: bool = False) -> None:
        """A barrier waited for every earlier access in `stages`; early: a
        wait on the last mark's event, for the accesses before the mark."""
        before = self.epoch if early else self.epoch + 1
        for table in (self.reads, self.writes):
            for key in list(table):
                kept = [e for e in table[key] if not (e[2] & stages and e[3] < before)]
                if kept:
                    table[key] = kept
                else:
                    del table[key]
        if stages & COMPUTE:
            self.alone = {e for e in self.alone if e >= before}
        self.marked = self.marked and early
        self.beside = False
        self.barriers += 1


def count_barriers(commands) -> int:
    h = Hazards()
    for cmd in commands:
        stages = h.wait_for(cmd)
        if stages:
            h.clear(stages, h.early)
        h.note(cmd)
    return h.barriers


def fill_word(value: float, dtype: str) -> int:
    """The 32-bit word a fill repeats to hold `value` in every element of `dtype`."""
    if dtype == "f32":
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]
    if dtype in HALF_DTYPES:
        half = int(bf16_bits([value])[0]) if dtype == "bf16" else int(np.array(value, np.float16).view(np.uint16))
        return half | half << 16
    return int(value) & 0xFFFFFFFF
