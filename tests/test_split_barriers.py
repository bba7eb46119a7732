"""Weight gradients beside the next product: the step's schedule moves a
backward product that nothing in the step reads to just before the next
product, keeps what it reads alive past it, and a mark (an event the device
sets) lets that next product wait only for the commands before the mark."""
from __future__ import annotations

import os

import attrs
import numpy as np
import pytest

from flowgrad.exec_vulkan import program
from flowgrad.exec_vulkan.lower import matmul_kernels as mk
from flowgrad.exec_vulkan.recorder import COMPUTE, BufView, Dispatch, FakeBuffer, Hazards, Mark, Recorder
from flowgrad.training.optim import SGD
from tests.test_attention_coop import COOP_ENV
from tests.test_mixed_precision import gpt


def _fake(n):
    return BufView(FakeBuffer(n * 4), 0, (n,), "f32")


def _waits(commands) -> list[tuple[int, bool]]:
    """(stages, by the mark's event) of the wait before each command."""
    h, out = Hazards(), []
    for cmd in commands:
        stages = h.wait_for(cmd)
        out.append((stages, h.early))
        if stages:
            h.clear(stages, h.early)
        h.note(cmd)
    return out


def test_a_command_that_needs_only_work_before_a_mark_waits_for_its_event_alone():
    rec = Recorder(None)
    a, b, c, e = _fake(8), _fake(8), _fake(8), _fake(8)
    rec.dispatch("accumulate", [a, b], push=[8])   # a += b
    rec.commands.append(Mark(None))
    rec.dispatch("accumulate", [c, b], push=[8])   # c += b: after the mark
    rec.dispatch("accumulate", [e, a], push=[8])   # needs a: the mark's event covers it
    rec.dispatch("accumulate", [e, c], push=[8])   # needs c, after the mark: a whole barrier
    rec.dispatch("accumulate", [a, e], push=[8])   # and the mark is spent: a barrier again
    assert _waits(rec.commands) == [(0, False), (0, False), (0, False), (COMPUTE, True), (COMPUTE, False),
                                    (COMPUTE, False)]


def test_a_product_after_a_mark_holds_back_no_later_product_and_one_after_the_wait_does():
    rec = Recorder(None)
    a, b, c, d, e = _fake(8), _fake(8), _fake(8), _fake(8), _fake(8)
    rec.dispatch("accumulate", [a, b], push=[8])   # a product (dX)
    rec.dispatch("accumulate", [c, a], push=[8])   # what reads it (an activation's backward)
    rec.commands.append(Mark(None))
    rec.dispatch("accumulate", [d, b], push=[8])   # a product nothing reads (dW), beside the next
    rec.dispatch("accumulate", [e, c], push=[8])   # the next product
    rec.dispatch("accumulate", [a, b], push=[8])   # a product after it
    products = {0, 3, 4, 5}
    rec.commands[:] = [attrs.evolve(c, alone=True) if i in products else c
                       for i, c in enumerate(rec.commands)]
    assert _waits(rec.commands) == [(0, False), (COMPUTE, False), (0, False), (0, False), (COMPUTE, True),
                                    (COMPUTE, False)]


def test_a_command_hoisted_to_a_marked_product_goes_after_the_next_product_too():
    """The unscale of a block's gradients reads the marked weight gradient: placed right after
    it, it would stand (with its barrier) between the two products the mark lets overlap."""
    rec = Recorder(None)
    w, x, dx, y, g = _fake(8), _fake(8), _fake(8), _fake(8), _fake(8)
    rec.commands.append(Mark(None))
    rec.dispatch("accumulate", [w, x], push=[8])    # the weight's gradient, marked
    rec.dispatch("accumulate", [dx, x], push=[8])   # the next product
    rec.dispatch("accumulate", [y, dx], push=[8])   # what reads it
    rec.dispatch("accumulate", [g, w], push=[8])    # the mover: reads the weight's gradient
    rec.commands[1:3] = [attrs.evolve(c, alone=True) for c in rec.commands[1:3]]
    mover = rec.commands[-1]
    cmds = list(rec.commands)
    program.hoist(cmds, [mover])
    assert cmds.index(mover) == 3
    cmds = rec.commands[1:]   # no mark: right after the product it reads
    program.hoist(cmds, [mover])
    assert cmds.index(mover) == 1


def test_weight_gradients_move_beside_the_next_product_keeping_what_they_read(monkeypatch):
    from flowgrad.exec_vulkan import memory
    from flowgrad.exec_vulkan.memory import _product
    from flowgrad.exec_vulkan.step_plan import step_plan

    monkeypatch.setattr(memory, "BESIDE_PRODUCTS", True)
    graph = gpt(layers=2).build("f32")
    step = step_plan(graph, True)
    g, mem = step.graph, step.memory
    sched = mem.schedule
    read = {i for s in sched for i in g.nodes[s.node].inputs}
    unread = [t for t, s in enumerate(sched)
              if _product(g.nodes[s.node]) and g.nodes[s.node].grad_of is not None and s.node not in read]
    beside = [t for t, s in enumerate(sched) if s.beside]
    # three weights a layer and the head's (the qkv weight's gradient is a block of a product the
    # step splits); the first layer's last has no product after it
    assert len(unread) == 3 * 2 + 1 and beside == unread[:-1]
    for t in beside:
        assert _product(g.nodes[sched[t + 1].node]), "moved to just before the next product"
        # what it reads lies in no buffer the next two steps write
        held = {mem.slots[("val", i)].buffer for i in g.nodes[sched[t].node].inputs}
        for s in sched[t + 1:t + 3]:
            assert mem.slots[("val", s.node)].buffer not in held, (t, s)


def test_marks_set_events_and_a_wait_on_one_sees_the_work_before_it(vk_device):
    from flowgrad.exec_vulkan.encoder import timed_submits
    from flowgrad.exec_vulkan.buffers import Buffer

    dev = vk_device
    bufs = [Buffer(dev, 4 * 64, "download") for _ in range(4)]
    a, b, c, e = (BufView(x, 0, (64,), "f32") for x in bufs)
    for x, v in zip(bufs, (1.0, 2.0, 3.0, 0.0)):
        x.write(np.full(64, v, np.float32))
    rec = Recorder(dev)
    rec.dispatch("accumulate", [a, b], push=[64])   # a = 3
    rec.commands.append(Mark(None))
    rec.dispatch("accumulate", [c, b], push=[64])   # c = 5
    rec.dispatch("accumulate", [e, a], push=[64])   # e = 3, by the mark's event
    rec.dispatch("accumulate", [e, c], push=[64])   # e = 8, by a barrier
    assert [early for _s, early in _waits(rec.commands)] == [False, False, False, True, False]
    events = dev.objects["event"]
    timed_submits(dev, rec.commands, 1, "a mark's test")
    assert dev.objects["event"] == events   # the encoding's event freed with it
    np.testing.assert_array_equal(e.buffer.read(0, 256).view(np.float32), np.full(64, 8.0, np.float32))
    np.testing.assert_array_equal(c.buffer.read(0, 256).view(np.float32), np.full(64, 5.0, np.float32))
    for x in bufs:
        x.free()


def coop_tile(device) -> str | None:
    """A tensor-core tile the device runs (its products are `alone`), or None; under the
    cooperative-matrix pass a device must have one."""
    info = device.info
    tiles = [t.shader for t in (*mk.coop_builds(info), *mk.cm2_builds(info))]
    if not tiles and os.environ.get(COOP_ENV) == "1":
        pytest.fail(f"{info.name} offers no cooperative matrices")
    return tiles[0] if tiles else None


def _step(device_kind, monkeypatch, split: bool, tile: str | None):
    """Three steps on the graph path, with weight gradients beside the next product (split) or
    where the backward put them: (losses, the last step's gradients, marks, tensor-core products)."""
    from flowgrad.exec_vulkan import memory

    monkeypatch.setattr(memory, "BESIDE_PRODUCTS", split)
    monkeypatch.setattr(program, "SPLIT_BARRIERS", split)
    recorded = []
    record = program.record_step

    def spied(rec, *args, **kw):
        record(rec, *args, **kw)
        recorded.append(rec.commands)
    monkeypatch.setattr(program, "record_step", spied)
    rng = np.random.default_rng(3)
    feeds = [{"tokens": rng.integers(0, 16, (8, 8)), "targets": rng.integers(0, 16, (8, 8))} for _ in range(3)]
    with mk.forced(tile):
        sess = gpt(layers=2).compile(device="vulkan", backward="graph", **device_kind)
        losses = [sess.step(f, optimizer=SGD(lr=0.05)).loss for f in feeds[:2]]
        res = sess.step(feeds[2])
    assert sess.last_path == "graph"
    commands = [c for cmds in recorded for c in cmds]
    marks = sum(isinstance(c, Mark) for c in commands)
    alone = sum(isinstance(c, Dispatch) and c.alone for c in commands)
    return losses + [res.loss], res.grads, marks, alone


@pytest.mark.parametrize("kind", [{"dtype": "f32"}, {"dtype": "f16"}], ids=["f32", "f16"])
def test_a_step_with_marks_computes_what_one_without_them_does(vk_device, monkeypatch, kind):
    """The same kernels in the same order of sums: losses and gradients bit for bit. Marks go
    before thin tensor-core products only: f16's products on a tensor-core tile where the
    device has one (the cooperative-matrix pass), else none, and what is tested is the
    schedule's move alone. (f16 keeps each weight's gradient as its product leaves it; under
    f16 mixed precision a cast reads it, and the product stays where it was.)"""
    tile = coop_tile(vk_device) if kind["dtype"] == "f16" else None
    on, on_grads, marks, alone = _step(kind, monkeypatch, True, tile)
    off, off_grads, no_marks, _ = _step(kind, monkeypatch, False, tile)
    assert no_marks == 0
    assert (marks >= 2 * 3, alone > 0) == ((True, True) if tile else (False, False))
    assert on == off
    for k, v in off_grads.items():
        np.testing.assert_array_equal(on_grads[k], v, err_msg=k)
