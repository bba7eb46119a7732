"""The memory a recording addresses before it exists (the scratch arena and
the index flag words share LateBuffer): allocated once after recording at
its final size, from the pool (and returned there) or as a buffer of its
own; a use before allocation is a DeviceError naming which memory."""
from __future__ import annotations

import pytest

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.index_checks import IndexChecks
from flowgrad.exec_vulkan.recorder import Arena, BufView


class FakeBuf:
    def __init__(self, nbytes, owner):
        self.nbytes, self.owner, self.handle, self.freed = nbytes, owner, object(), False

    def free(self):
        self.freed = True


class FakeDevice:
    def __init__(self):
        self.made = []

    def buffer(self, nbytes, kind="device"):
        self.made.append(FakeBuf(nbytes, "device"))
        return self.made[-1]


class FakePool:
    def __init__(self):
        self.out, self.back = [], []

    def acquire(self, nbytes, kind):
        self.out.append(FakeBuf(nbytes, "pool"))
        return self.out[-1]

    def release(self, buf):
        self.back.append(buf)


def test_an_arena_is_allocated_at_its_high_water_size_and_freed_once():
    arena, dev = Arena(), FakeDevice()
    arena.alloc(100)
    top = arena.top
    arena.alloc(10)
    arena.top = top                      # a lowering call's scratch released: the high-water mark stays
    with pytest.raises(DeviceError, match="scratch arena used before its buffer was allocated"):
        arena.handle
    arena.materialize(dev)
    assert [b.nbytes for b in dev.made] == [arena.high] and arena.high > 100
    assert arena.handle is dev.made[0].handle
    arena.free()
    arena.free()
    assert dev.made[0].freed and arena.buffer is None


def test_pooled_memory_goes_back_to_its_pool():
    checks, pool = IndexChecks(), FakePool()
    view = checks.slot(node=None, pos=0, ids=BufView(None, 0, (4,), "i32"), bound=3)
    assert view.buffer is checks and view.shape == (1,)
    with pytest.raises(DeviceError, match="index flags used before its buffer was allocated"):
        checks.handle
    checks.materialize(FakeDevice(), pool)
    assert [b.nbytes for b in pool.out] == [checks.nbytes] and checks.handle is pool.out[0].handle
    checks.free()
    assert pool.back == pool.out and not pool.out[0].freed and checks.buffer is None


def test_nothing_recorded_allocates_nothing():
    dev = FakeDevice()
    for late in (Arena(), IndexChecks()):
        late.materialize(dev)
        late.free()
    assert dev.made == []
