"""models/cnn.flow (conv, batch norm, pooling, dropout): a short training
run learns on numpy, and the model takes the graph path on Vulkan with
gradients and running statistics matching numpy's. The full accuracy run is
in test_train_accuracy (-m slow)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.bench.step import feeds_for
from flowgrad.training.optim import SGD, Adam

MODEL = Path(__file__).resolve().parent.parent / "models" / "cnn.flow"


def test_a_short_run_learns():
    res = fg.train(fg.load(MODEL, config={"batch": 16}), device="cpu", progress=False, steps=25,
                   optimizer=Adam(lr=1e-2))
    losses = [r["loss"] for r in res.history]
    assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5]), losses
    assert res.metrics["accuracy"] > 0.3  # chance is 0.1


@pytest.mark.vulkan
def test_takes_the_graph_path_and_matches_numpy(vk_device):
    model = fg.load(MODEL, config={"batch": 4})
    sess = model.compile(device="vulkan")
    assert sess.last_path == "graph"
    assert sess.explain().to_dict()["refusals"] == []
    ref = model.compile(device="cpu")
    feeds = feeds_for(sess.graph)
    for _ in range(2):  # two training steps: the second sees the first's running statistics and update
        got, want = sess.step(feeds, optimizer=SGD(lr=0.1)), ref.step(feeds, optimizer=SGD(lr=0.1))
    assert sess.last_path == "graph"
    np.testing.assert_allclose(got.loss, want.loss, rtol=1e-4)
    for k, p in ref.params.items():
        np.testing.assert_allclose(sess.params[k], p, rtol=1e-3, atol=1e-5 * max(np.abs(p).max(), 1), err_msg=k)
    ev, ev_ref = sess.step(feeds, grads=False), ref.step(feeds, grads=False)
    np.testing.assert_allclose(ev.outputs["logits"], ev_ref.outputs["logits"], rtol=1e-3, atol=1e-4)


@pytest.mark.vulkan
def test_mixed_runs_its_convolutions_in_f16_on_the_graph_path(vk_device):
    """dtype="mixed": every convolution computes in f16, on cooperative matrices
    where the device has them, else on the f16 register tile; graph and closures agree."""
    from flowgrad.loss_scale import LossScaler

    model = fg.load(MODEL, config={"batch": 64})
    kw = {"dtype": "mixed", "loss_scale": LossScaler(init_scale=64.0)}   # no overflow in the compared step
    graph = model.compile(device="vulkan", backward="graph", **kw)
    closures = model.compile(device="vulkan", backward="closures", **kw)
    assert graph.last_path == "graph" and closures.last_path.startswith("closures")
    from flowgrad.exec_vulkan.lower.conv import DEFAULT_COOP

    want = DEFAULT_COOP if getattr(vk_device.info, "coopmat_f16", False) else "conv_64x64_k16"
    convs = [n for n in graph.explain().to_dict()["nodes"] if n["op"] == "conv2d"]
    assert len(convs) == 3 and all(n["dtype"] == "f16" for n in convs)
    for n in convs:
        assert {k for k in n["kernels"]["forward"] + n["kernels"]["backward"] if k.startswith("conv_")} == {want}, n
    feeds = feeds_for(graph.graph)
    got, ref = graph.step(feeds), closures.step(feeds)
    assert "conv2d" not in closures.runner.executor.kernels.on_numpy
    np.testing.assert_allclose(got.loss, ref.loss, rtol=2e-2)
    for k, g in ref.grads.items():
        assert np.isfinite(g).all() and np.abs(g).max() > 0, k
        np.testing.assert_allclose(got.grads[k], g, rtol=2e-2, atol=2e-2 * np.abs(g).max(), err_msg=k)
