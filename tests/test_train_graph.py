"""Training on the graph path (one recorded command buffer per step, the
optimizer update included) against closures on the same Vulkan device and
against numpy. Each test first asserts the path taken:
a gradient check alone would pass with the graph path silently refused."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.training import checkpoint
from flowgrad.trainer import TrainInterrupted

MODELS = Path(__file__).resolve().parent.parent / "models"

pytestmark = pytest.mark.vulkan

CASES = {
    "mlp": ("mlp.flow", {"hidden": 32}),
    "tiny_gpt": ("tiny_gpt.flow", {"d": 32, "layers": 1, "seq": 8, "batch": 8, "ff": 64}),
}


def run(name, backward, device="vulkan", **kw):
    file, config = CASES[name]
    return fg.train(fg.load(MODELS / file, config), steps=kw.pop("steps", 20), device=device, backward=backward,
                    progress=False, **kw)


@pytest.mark.parametrize("name", CASES)
def test_graph_and_closures_agree_after_20_steps(vk_device, name):
    graph = run(name, "graph")
    assert graph.path == "graph"
    closures = run(name, "closures")
    assert closures.path.startswith("closures")
    numpy = run(name, "closures", device="cpu")
    for k, v in graph.session.params.items():
        assert np.isfinite(v).all()
        np.testing.assert_allclose(v, closures.session.params[k], rtol=1e-4, atol=1e-4, err_msg=k)
        np.testing.assert_allclose(v, numpy.session.params[k], rtol=1e-3, atol=1e-4, err_msg=k)
    np.testing.assert_allclose([r["loss"] for r in graph.history], [r["loss"] for r in closures.history],
                               rtol=1e-4)
    losses = [r["loss"] for r in graph.history]
    assert np.mean(losses[-5:]) < np.mean(losses[:5])


def test_clipped_adamw_with_a_schedule_on_the_graph_path(vk_device):
    from flowgrad.training.optim import AdamW

    def opt():
        return AdamW(lr=3e-3, clip=0.5, schedule="cosine", warmup=5, total_steps=20)

    graph = run("mlp", "graph", optimizer=opt())
    assert graph.path == "graph"
    closures = run("mlp", "closures", optimizer=opt())
    for k, v in graph.session.params.items():
        np.testing.assert_allclose(v, closures.session.params[k], rtol=1e-4, atol=1e-4, err_msg=k)


def test_graph_path_resume_equals_uninterrupted(vk_device, tmp_path):
    full = run("mlp", "graph", out=tmp_path / "a")

    def stop(step, rec):
        if step == 7:
            raise KeyboardInterrupt

    with pytest.raises(TrainInterrupted):
        run("mlp", "graph", out=tmp_path / "b", callback=stop)
    ck = checkpoint.load(tmp_path / "b" / "checkpoint.safetensors")
    assert ck.step == 7 and np.abs(ck.opt_state["w1"]["exp_avg"]).max() > 0  # state read back from the device
    resumed = run("mlp", "graph", out=tmp_path / "b", resume=True)
    assert resumed.path == "graph" and resumed.steps_run == 13
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in full.history]
    for k, v in full.session.params.items():
        np.testing.assert_array_equal(v, resumed.session.params[k])


def test_a_new_optimizer_object_goes_on_from_the_sessions_state(vk_device):
    """An optimizer made afresh each step (to set its lr by hand, say) steps the
    one state the session holds, as on closures: the graph path started each
    new object from zero moments at the session's step count, and kept a
    recorded program per object."""
    from flowgrad.training.optim import Adam
    from flowgrad.update_counts import Counts

    file, config = CASES["mlp"]
    model = fg.load(MODELS / file, config)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.random((64, 64), dtype=np.float32), "y": rng.integers(0, 10, 64).astype(np.int32)}
             for _ in range(6)]
    graph = model.compile(device="vulkan", backward="graph", seed=0)
    assert graph.last_path == "graph"
    closures = model.compile(device="cpu", seed=0)
    for i, f in enumerate(feeds):
        lr = 1e-2 / (1 + i)
        graph.step(f, grads=False, optimizer=Adam(lr=lr))
        closures.step(f, grads=False, optimizer=Adam(lr=lr))
    assert len(graph.runner.programs) == 1 and len(graph.runner.opt_state) == 1
    for k, v in graph.params.items():
        np.testing.assert_allclose(v, closures.params[k], rtol=1e-4, atol=1e-5, err_msg=k)
    counts, state = graph.runner.get_opt_state()
    assert counts == Counts(updates=6, iterations=6)
    np.testing.assert_allclose(state["w1"]["exp_avg_sq"], closures.runner.get_opt_state()[1]["w1"]["exp_avg_sq"],
                               rtol=1e-4, atol=1e-10)
