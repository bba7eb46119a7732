"""Read-backs on the graph path: the download copies are recorded in
groups of about readback.GROUP_BYTES, each right after the last command
that writes a source of its copies (so a late layer's gradients travel
while the backward of the earlier layers runs) and followed by an event,
the host copies each signalled group out of staging while the step still
runs, and what a step returns is bitwise what reading everything back at
the step's end gave."""
from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.exec_vulkan import program, readback, submit
from flowgrad.bench.step import feeds_for
from flowgrad.exec_vulkan.recorder import Copy, Signal, depends, touched
from flowgrad.training.optim import Adam

MODELS = Path(__file__).resolve().parent.parent / "models"
READ_BACK = ("read-back", "transfer")
GPT = {"d": 32, "layers": 2, "seq": 8, "batch": 4, "ff": 64}
# an index computed on the device: its kernel flags a bad one, read back last
EMBED = ("input f: f32[3]\nparam table: f32[5, 2] = normal()\ne = embedding(cast(f, i32), table)\n"
         "loss = sum(e * e)\noutput e\nminimize loss\n")
# models this small fill no group of the default size: smaller ones make the early path
GROUPS = {"one, after the fence": None, "each copy": 1, "16 KiB": 16 << 10}

pytestmark = pytest.mark.vulkan


def model(name):
    if name == "embed":
        return fg.loads(EMBED, file="idx.flow")
    return fg.load(MODELS / f"{name}.flow", GPT if name == "tiny_gpt" else None)


def compile_graph(m, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = m.compile(device="vulkan", backward="graph", **kw)
    assert sess.last_path == "graph", sess.last_path
    return sess


@contextlib.contextmanager
def reading_back_at_the_end(monkeypatch):
    """Programs built inside record every read-back after the whole step and
    copy them to the host after its fence, as before."""
    with monkeypatch.context() as m:
        m.setattr(program, "place_after_last_writer", lambda commands, copies, batch_bytes: None)
        m.setattr(program, "hoist", lambda commands, movers: None)
        m.setattr(readback, "GROUP_BYTES", 1 << 62)
        yield


@pytest.fixture(params=sorted(GROUPS))
def groups(request, monkeypatch):
    """The read-back group size programs are recorded with."""
    if GROUPS[request.param] is not None:
        monkeypatch.setattr(readback, "GROUP_BYTES", GROUPS[request.param])
    return request.param


def writes(cmd, view) -> bool:
    end = view.offset + view.nbytes
    return any(buf is view.buffer and lo < end and view.offset < hi for buf, lo, hi in touched(cmd)[1])


def check_placement(prog, each=False):
    """Every run of read-back commands follows the last writer of a source
    of its copies, each copy follows its own and nothing before the
    optimizer overwrites its source; with each=True every copy comes right
    after its own source's last writer."""
    cmds = prog.rec.commands
    step_end = next((i for i, c in enumerate(cmds) if c.label == ("optimizer", "optimizer")), len(cmds))
    copies = [i for i, c in enumerate(cmds) if c.label == READ_BACK and isinstance(c, Copy)]
    assert copies and copies[-1] < step_end
    assert sorted(cmds[i].dst.offset for i in copies) == sorted(s.offset for _n, _d, s in prog.layout.io.downloads
                                                                if s.nbytes)
    for i in copies:
        src = cmds[i].src
        writers = [j for j in range(step_end) if j != i and writes(cmds[j], src)]
        assert not [j for j in writers if j > i], f"read-back {i} is overwritten before the step's end"
        if src.buffer is prog.rec.checks:   # the index flags: after every index kernel, with the last read-backs
            assert all(c.label == READ_BACK for c in cmds[i:step_end])
            continue
        assert writers, f"read-back {i} has no writer"
        run = i
        while cmds[run - 1].label == READ_BACK:
            run -= 1
        assert writers[-1] < run, i
        placed = run - 1   # the command the run follows: the last writer of one of its copies
        if each:
            assert placed == writers[-1], i
        else:
            later = next((j for j in range(run, step_end) if cmds[j].label != READ_BACK), step_end)
            assert any(isinstance(c, Copy) and writes(cmds[placed], c.src) for c in cmds[run:later]), i
    return cmds, copies


@pytest.mark.parametrize("name", ["tiny_gpt", "mlp", "embed"])
def test_read_backs_follow_the_last_writers_of_their_sources(vk_device, monkeypatch, groups, name):
    sess = compile_graph(model(name))
    prog = sess.runner._program(True, False, Adam(1e-3))   # gradients back and Adam on the device
    cmds, copies = check_placement(prog, each=groups == "each copy")
    backward = [i for i, c in enumerate(cmds) if c.label and c.label[1] == "backward"]
    if groups == "each copy" and name != "embed" or GROUPS[groups] and name == "tiny_gpt":
        assert copies[0] < backward[-1], "every read-back still waits for the whole backward"
    for k, c in enumerate(cmds):   # a signal closes each group of copies and stays with them
        if isinstance(c, Signal):
            assert cmds[k - 1].label == READ_BACK and isinstance(cmds[k - 1], Copy)


@pytest.mark.parametrize("name", ["tiny_gpt", "mlp", "cnn", "char_gpt"])
@pytest.mark.parametrize("mode", ["grads", "grads+adam"])
def test_steps_return_what_reading_back_at_the_end_returned(vk_device, monkeypatch, groups, name, mode):
    m = model(name)
    new = compile_graph(m)
    feeds = feeds_for(new.graph)
    with reading_back_at_the_end(monkeypatch):
        old = compile_graph(m)
        old.set_params(new.params)
        want = steps(old, feeds, mode)
    got = steps(new, feeds, mode)
    assert_same(got, want)
    for prog in new.runner.programs.values():
        check_placement(prog, each=groups == "each copy")
        if GROUPS[groups] is None:
            assert signals(prog) == 0
        else:
            assert_signals_have_work_after(prog)
            assert signals(prog) > 0 or name not in ("tiny_gpt", "char_gpt")
    for prog in old.runner.programs.values():   # the reference did read back at the end
        labels = [c.label for c in prog.rec.commands]
        assert READ_BACK not in labels[:max(i for i, x in enumerate(labels) if x[1] == "backward")]


def assert_signals_have_work_after(prog):
    """A group is signalled only where a share (readback.FOLLOWING) of the step's dispatches follows."""
    from flowgrad.exec_vulkan import readback
    from flowgrad.exec_vulkan.recorder import Dispatch

    cmds = prog.rec.commands
    total = sum(isinstance(c, Dispatch) for c in cmds)
    for k, c in enumerate(cmds):
        if isinstance(c, Signal):
            assert sum(isinstance(d, Dispatch) for d in cmds[k:]) >= total * readback.FOLLOWING, k


def steps(sess, feeds, mode, n=2):
    opt = Adam(1e-2) if mode == "grads+adam" else None
    out = [sess.step(feeds, optimizer=opt) for _ in range(n)]
    return out, sess.params


def assert_same(got, want):
    (got_steps, got_params), (want_steps, want_params) = got, want
    for g, w in zip(got_steps, want_steps):
        assert g.loss == w.loss
        for part in ("outputs", "grads"):
            a, b = getattr(g, part), getattr(w, part)
            assert a.keys() == b.keys()
            for k in a:
                np.testing.assert_array_equal(a[k], b[k], err_msg=f"{part} {k}")
    for k in want_params:
        np.testing.assert_array_equal(got_params[k], want_params[k], err_msg=k)


def test_mixed_precision_steps_return_what_reading_back_at_the_end_returned(vk_device, monkeypatch, groups):
    m = model("tiny_gpt")
    new = compile_graph(m, dtype="mixed")
    feeds = feeds_for(new.graph)
    with reading_back_at_the_end(monkeypatch):
        old = compile_graph(m, dtype="mixed")
        old.set_params(new.params)
        want = steps(old, feeds, "grads+adam", n=3)
    got = steps(new, feeds, "grads+adam", n=3)
    assert_same(got, want)


def test_a_flagged_index_still_raises_and_updates_nothing(vk_device, monkeypatch, groups):
    m = model("embed")
    good, bad = ({"f": np.array(v, np.float32)} for v in ([0.0, 4.0, 2.0], [0.0, 7.0, 2.0]))
    results, start = [], None
    for context in (contextlib.nullcontext(), reading_back_at_the_end(monkeypatch)):
        with context:
            sess = compile_graph(m)
            if start is None:
                start = sess.params
            sess.set_params(start)
            before = sess.params
            opt = Adam(1e-2)
            with pytest.raises(fg.FlowError, match="out of range"):
                sess.step(bad, optimizer=opt)
            for k, v in sess.params.items():
                np.testing.assert_array_equal(v, before[k])
            results.append(([sess.step(good, optimizer=opt) for _ in range(2)], sess.params))
    assert_same(*results)


def test_hoist_moves_a_command_to_right_after_the_nearest_it_depends_on():
    from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer, Fill

    a, b, c = (BufView(FakeBuffer(64), 0, (16,), "f32") for _ in range(3))
    label = ("x", "backward")
    writes_a, writes_b, reads_c = Fill(a, 0, label), Fill(b, 0, label), Copy(c, b, label)
    mover = Copy(a, c, label)   # reads a, writes c
    cmds = [writes_a, writes_b, Fill(b, 1, label), mover]
    program.hoist(cmds, [mover])
    assert cmds.index(mover) == 1   # right after the write of a, before the unrelated fills of b
    cmds = [writes_a, reads_c, writes_b, mover]
    program.hoist(cmds, [mover])
    assert cmds.index(mover) == 2   # not before a read of the c it overwrites
    cmds = [writes_a, Fill(c, 0, label), writes_b, mover]
    program.hoist(cmds, [mover])
    assert cmds.index(mover) == 2   # nor before another write of c


def test_a_blocks_unscale_runs_once_its_gradients_are_final(vk_device):
    """Mixed precision: each unscale dispatch (a batch of gradients, in the order they become
    final) sits right after the last command writing what it reads, so the early batches run,
    and are read back, while the backward of the earlier blocks still runs."""
    from flowgrad.exec_vulkan.recorder import Dispatch

    sess = compile_graph(model("tiny_gpt"), dtype="mixed", mixed="f16")
    prog = sess.runner._program(True, False, None)
    cmds = prog.rec.commands
    unscales = [i for i, c in enumerate(cmds) if isinstance(c, Dispatch) and c.shader.startswith("unscale")]
    backward = [i for i, c in enumerate(cmds) if isinstance(c, Dispatch) and c.label[0] != "loss scale"
                and c.label[1] == "backward"]
    assert len(unscales) > 1 and unscales[0] < backward[-1]
    for u in unscales:
        assert depends(cmds[u], cmds[u - 1]), u


def signals(prog) -> int:
    return sum(isinstance(c, Signal) for c in prog.rec.commands)


def test_ready_groups_are_read_before_the_fence(vk_device, monkeypatch):
    m = model("tiny_gpt")
    new = compile_graph(m)
    feeds = feeds_for(new.graph)
    with reading_back_at_the_end(monkeypatch):
        old = compile_graph(m)
        old.set_params(new.params)
        want = steps(old, feeds, "grads+adam")
    monkeypatch.setattr(readback, "GROUP_BYTES", 1)

    def slow_fence(device, fences, timeout_ns):
        """A device slower than any: the fence has not signalled by any poll."""
        time.sleep(timeout_ns * 1e-9)
        return submit.VK_TIMEOUT

    monkeypatch.setattr(submit, "_short_wait", slow_fence)
    stats = new.runner.device.stats
    before = stats["reads_before_fence"]
    got = steps(new, feeds, "grads+adam")
    assert_same(got, want)
    (prog,) = new.runner.programs.values()
    assert len(prog.events.handles) == signals(prog) == len(prog.host.groups) > 5
    assert stats["reads_before_fence"] - before == 2 * len(prog.host.groups)


def test_arrays_a_caller_holds_keep_their_values(vk_device, monkeypatch, groups):
    sess = compile_graph(model("tiny_gpt"))
    feeds, opt = feeds_for(sess.graph), Adam(1e-2)
    first = sess.step(feeds, optimizer=opt)
    kept = {k: g.copy() for k, g in first.grads.items()}
    second = sess.step(feeds, optimizer=opt)   # the params moved: other gradients, into another block
    for k in kept:
        np.testing.assert_array_equal(first.grads[k], kept[k])
        assert not np.array_equal(second.grads[k], kept[k]), k
    where = {k: g.__array_interface__["data"][0] for k, g in second.grads.items()}
    del first, second
    third = sess.step(feeds, optimizer=opt)   # nothing held: the second step's block again
    assert {k: g.__array_interface__["data"][0] for k, g in third.grads.items()} == where


def test_an_interrupted_wait_lets_the_step_finish_and_the_session_step_on(vk_device, monkeypatch):
    monkeypatch.setattr(readback, "GROUP_BYTES", 1)
    sess = compile_graph(model("mlp"))
    feeds = feeds_for(sess.graph)
    want = sess.step(feeds)
    calls = []

    def interrupted(self, k):
        calls.append(k)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(readback.ReadyEvents, "is_set", interrupted)
        with pytest.raises(KeyboardInterrupt):
            sess.step(feeds)
    assert calls
    got = sess.step(feeds)    # the fence was waited for and reset: the next submission may use it
    assert got.loss == want.loss
    for k in want.grads:
        np.testing.assert_array_equal(got.grads[k], want.grads[k])
