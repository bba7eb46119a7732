"""Gradient buckets of the data-parallel all-reduce, in one process: the
layout (reverse topological order, bucket size), and that on closures each
bucket is posted during the backward, as soon as its gradients are final.
The runs over MPI are in test_distributed.py."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError
from flowgrad.exec_closure import NumpyKernels
from flowgrad.bench.step import feeds_for
from flowgrad.training import distributed
from flowgrad.training.grad_buckets import GradBuckets


class CountingKernels(NumpyKernels):
    """Counts the backward's ops as they run (the nodes of the backward graph)."""

    def __init__(self):
        self.vjps = 0

    def forward(self, node, ins):
        self.vjps += node.grad_of is not None
        return super().forward(node, ins)


def test_params_are_laid_out_in_the_order_their_gradients_become_final():
    graph = fg.load("models/mlp.flow").build()
    one = GradBuckets(graph, 16 << 20)
    assert one.order == ["b2", "w2", "b1", "w1"] and len(one.bounds) == 1
    small = GradBuckets(graph, 4096)        # 1024 floats: w2 (1280) and w1 (8192) are buckets of their own
    assert [small.slot[n][0] for n in small.order] == [0, 1, 2, 3]
    assert small.bounds == [[0, 10], [10, 1290], [1290, 1418], [1418, 9610]]
    mixed = GradBuckets(graph, 4 * 1420)   # b2, w2 and b1 fit one bucket
    assert [mixed.slot[n][0] for n in mixed.order] == [0, 0, 0, 1]


def test_on_closures_buckets_are_posted_during_the_backward_in_reverse_order():
    model = fg.load("models/tiny_gpt.flow")
    sess = model.compile(device="cpu")
    kernels = CountingKernels()
    sess.runner.executor.kernels = kernels
    buckets = GradBuckets(sess.graph, 8192)
    assert len(buckets.bounds) > 4
    posted = []

    def post(array):
        posted.append(kernels.vjps)     # how far the backward had got
        return array.copy()             # the "request": what was sent

    buckets.begin(post)
    feeds = feeds_for(sess.graph, seed=0)
    res = sess.step(feeds, grads=True, on_grad_final=buckets.final)
    assert buckets.posted_order == list(range(len(buckets.bounds)))
    assert posted[0] < posted[-1] and posted[-2] < kernels.vjps   # all but the last bucket overlap the backward
    sent = np.concatenate(buckets.requests)
    want = np.concatenate([res.grads[n].reshape(-1) for n in buckets.order]).astype(np.float32)
    np.testing.assert_array_equal(sent, want)         # each bucket held its final gradients when posted


def test_a_param_no_gradient_reaches_is_reported_as_zeros():
    model = fg.loads("""
model m
input x: f32[3]
param w: f32[3] = zeros()
param unused: f32[2] = zeros()
loss = sum(x * w)
minimize loss
""")
    sess = model.compile(device="cpu")
    got = {}
    sess.step({"x": np.ones(3, np.float32)}, on_grad_final=lambda n, d: got.setdefault(n, d))
    assert set(got) == {"w", "unused"}
    np.testing.assert_array_equal(got["unused"], np.zeros(2, np.float32))


def test_the_graph_path_reports_every_gradient_after_its_one_submit(vk_device):
    sess = fg.load("models/mlp.flow").compile(device="vulkan", backward="graph")
    assert sess.last_path == "graph"
    got = {}
    res = sess.step(feeds_for(sess.graph, seed=0), on_grad_final=lambda n, d: got.setdefault(n, d.copy()))
    assert set(got) == set(sess.graph.trainable())
    for name, d in got.items():
        np.testing.assert_array_equal(d, res.grads[name])


@pytest.mark.parametrize("value", ["abc", "0", "-1"])
def test_the_bucket_size_setting_is_checked(monkeypatch, value):
    monkeypatch.setenv(distributed.BUCKET_ENV, value)
    with pytest.raises(FlowError, match=distributed.BUCKET_ENV):
        distributed._env_number(distributed.BUCKET_ENV, 16.0, "a size in MiB")
