"""Runs of independent cast_f16 dispatches recorded back to back (mixed
precision's param and gradient casts) become one cast_f16_multi dispatch per
15 (exec_vulkan/multi_tensor.py): merged only when independent and of one
direction, and bit-identical to the unmerged step on Vulkan."""
from __future__ import annotations

import numpy as np
import pytest

from flowgrad.feeds import random_feeds
from test_fusion import GPT_TINY, gpt


# the scalar kernels' dispatches (conftest.scalar_kernels)
pytestmark = pytest.mark.usefixtures("scalar_kernels")


def test_runs_of_casts_become_one_dispatch_and_dependent_ones_do_not():
    from flowgrad.exec_vulkan.multi_tensor import merge_casts
    from flowgrad.exec_vulkan.optim_records import groups_for
    from flowgrad.exec_vulkan.recorder import BufView, FakeBuffer, Recorder

    def view(n, dtype):
        return BufView(FakeBuffer(4 * n), 0, (n,), dtype)

    rec = Recorder(None)
    wide = [view(n, "f32") for n in (5, 300, 7)]
    half = [view(n, "f16") for n in (5, 300, 7)]
    for w, h in zip(wide, half):
        rec.dispatch("cast_f16", [w, h], push=[w.size, 0], groups=(1, 1, 1))
    rec.dispatch("cast_f16", [view(5, "f32"), half[0]], push=[5, 1], groups=(1, 1, 1))   # reads a result
    rec.dispatch("cast_f16", [wide[1], view(300, "f16")], push=[300, 1], groups=(2, 1, 1))
    merge_casts(rec, groups_for)
    assert [c.shader for c in rec.commands] == ["cast_f16_multi", "cast_f16_multi"]
    first = rec.commands[0]
    assert first.views[:3] == tuple(wide) and first.views[15:18] == tuple(half)
    rec = Recorder(None)
    rec.dispatch("cast_f16", [wide[0], half[0]], push=[5, 0], groups=(1, 1, 1))
    rec.dispatch("cast_f16", [wide[0], half[1]], push=[5, 1], groups=(1, 1, 1))   # the other way: not merged
    merge_casts(rec, groups_for)
    assert [c.shader for c in rec.commands] == ["cast_f16", "cast_f16"]


def test_merged_casts_are_bit_identical_on_vulkan(vk_device, monkeypatch):
    import flowgrad.exec_vulkan.multi_tensor as multi
    from flowgrad.training.optim import AdamW

    def steps():
        sess = gpt(GPT_TINY).compile(device="vulkan", dtype="mixed", backward="graph", seed=1)
        assert sess.last_path == "graph"
        opt = AdamW(lr=1e-2)
        feeds = random_feeds(sess.graph, seed=2, int_high=4)
        sess.step(feeds, optimizer=opt)
        res = sess.step(feeds)
        return sess, res
    merged, res_m = steps()
    shaders = {c.shader for p in merged.runner.programs.values() for c in p.rec.commands if hasattr(c, "shader")}
    assert "cast_f16_multi" in shaders
    monkeypatch.setattr(multi, "fits", lambda rec, bindings: False)
    plain, res_p = steps()
    shaders = {c.shader for p in plain.runner.programs.values() for c in p.rec.commands if hasattr(c, "shader")}
    assert "cast_f16_multi" not in shaders and "cast_f16" in shaders
    assert np.array_equal(res_m.loss, res_p.loss)
    for k in res_m.grads:
        assert np.array_equal(res_m.grads[k], res_p.grads[k]), k
    for k, v in merged.params.items():
        assert np.array_equal(v, plain.params[k]), k
