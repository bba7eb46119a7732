"""Both example models, at their own config, take the graph path on any
Vulkan device (lavapipe in CI), and their graph gradients match numpy's."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.bench.step import feeds_for

MODELS = Path(__file__).resolve().parent.parent / "models"

pytestmark = pytest.mark.vulkan


@pytest.mark.parametrize("name", ["mlp", "tiny_gpt"])
def test_example_model_takes_the_graph_path_and_matches_numpy(vk_device, name):
    model = fg.load(MODELS / f"{name}.flow")
    sess = model.compile(device="vulkan")
    assert sess.last_path == "graph"
    assert sess.explain().to_dict()["refusals"] == []
    feeds = feeds_for(sess.graph)
    graph = sess.step(feeds)
    ref = model.compile(device="cpu").step(feeds)
    np.testing.assert_allclose(graph.loss, ref.loss, rtol=1e-4)
    for k, g in ref.grads.items():
        assert np.abs(graph.grads[k]).max() > 0, k
        np.testing.assert_allclose(graph.grads[k], g, rtol=2e-3, atol=2e-5 * np.abs(g).max(), err_msg=k)
