"""Gradient buckets for the data-parallel all-reduce.

The trainable params are laid out in one f32 buffer in the order their
gradients become final during a backward (reverse topological order: a
param's gradient is final once the earliest node that reads it has run its
VJP) and cut into buckets of at most `bucket_bytes` (a larger param is a
bucket of its own). As soon as the last gradient of a bucket is final, the
bucket's sum across ranks is posted as a non-blocking Allreduce, so on the
closures path the reduction of the later layers' gradients overlaps with the
backward of the earlier ones. The sum of each element over the ranks does
not depend on the bucketing, so any bucket size gives the same numbers."""
from __future__ import annotations

import numpy as np

DEFAULT_BUCKET_MB = 16.0


def layout(order: list[str], sizes: dict[str, int], bucket_bytes: int):
    """(name -> (bucket, start, stop), [[start, stop] of each bucket]) of f32
    gradients of `sizes` elements packed in `order`."""
    slot: dict[str, tuple[int, int, int]] = {}
    bounds: list[list[int]] = []
    per_bucket = max(1, bucket_bytes // 4)
    at = 0
    for n in order:
        if not bounds or (at - bounds[-1][0] + sizes[n] > per_bucket and at > bounds[-1][0]):
            bounds.append([at, at])
        slot[n] = (len(bounds) - 1, at, at + sizes[n])
        at += sizes[n]
        bounds[-1][1] = at
    return slot, bounds


def final_order(graph) -> list[str]:
    """The trainable params in the order their gradients become final."""
    trainable = graph.trainable()
    users = graph.users()
    # the last param to become final is the one read first; params nothing reads come last
    first_use = {name: min(users[i], default=len(graph.nodes)) for name, i in trainable.items()}
    return sorted(trainable, key=lambda n: -first_use[n])


def bucket_count(graph, bucket_bytes: int) -> int:
    """How many buckets GradBuckets(graph, bucket_bytes) cuts (without its buffer)."""
    sizes = {n: graph.nodes[i].type.size for n, i in graph.trainable().items()}
    return len(layout(final_order(graph), sizes, bucket_bytes)[1])


class GradBuckets:
    def __init__(self, graph, bucket_bytes: int):
        self.graph = graph
        trainable = graph.trainable()
        self.order = final_order(graph)
        self.shapes = {n: graph.nodes[trainable[n]].shape for n in trainable}
        self.names = list(trainable)
        sizes = {n: graph.nodes[trainable[n]].type.size for n in trainable}
        self.flat = np.empty(sum(sizes.values()), np.float32)
        # slot: name -> (bucket, start, stop) in flat; bounds: [start, stop] of each bucket
        self.slot, self.bounds = layout(self.order, sizes, bucket_bytes)
        self.count = [0] * len(self.bounds)
        for b, _, _ in self.slot.values():
            self.count[b] += 1
        self.begin(None)

    def begin(self, post) -> None:
        """Start a step: nothing final, nothing posted. post(array) starts the
        in-place sum of `array` across ranks and returns its request."""
        self.post = post
        self.pending = list(self.count)
        self.seen: set[str] = set()
        self.requests: list = []
        self.posted_order: list[int] = []

    def final(self, name: str, grad) -> None:
        """`name`'s gradient is final (None: it has none, i.e. zeros)."""
        if name in self.seen:
            raise RuntimeError(f"the gradient of {name} was reported twice in one step")
        self.seen.add(name)
        b, lo, hi = self.slot[name]
        if grad is None:
            self.flat[lo:hi] = 0.0
        else:
            self.flat[lo:hi] = np.asarray(grad).reshape(-1)
        self.pending[b] -= 1
        if self.pending[b] == 0:
            start, stop = self.bounds[b]
            self.requests.append(self.post(self.flat[start:stop]))
            self.posted_order.append(b)

    def unposted(self) -> list[str]:
        return [n for n in self.order if n not in self.seen]

    def averaged(self, size: int) -> dict[str, np.ndarray]:
        """After every request completed: the mean over `size` ranks, by name
        (views of the buffer, valid until the next step)."""
        self.flat *= np.float32(1.0 / size)
        return {n: self.flat[self.slot[n][1]:self.slot[n][2]].reshape(self.shapes[n]) for n in self.names}
