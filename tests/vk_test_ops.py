"""Tiny ops with lowerings over the runtime's own accumulate shader, so the
Vulkan runtime and the graph executor can be tested without the kernel
authors' lowerings. Registered once, under names no real op uses."""
from __future__ import annotations

import contextlib

import numpy as np

from flowgrad.graph import TensorType
from flowgrad.exec_vulkan.lowering import Lowering, register_lowering
from flowgrad.ops import OPS, Arg, Op, OpTypeError, register
from flowgrad.exec_vulkan.recorder import grid


def _acc(rec, dst, src):
    rec.dispatch("accumulate", [dst, src], push=[dst.size], groups=grid(dst.size),
                 variant="f16" if dst.dtype == "f16" else None)


def _same(ins, attrs):
    if len({t.shape for t in ins}) != 1 or len({t.dtype for t in ins}) != 1:
        raise OpTypeError("vk_test ops take inputs of one shape and dtype")
    return TensorType(ins[0].shape, ins[0].dtype)


def _add_fwd(rec, node, ins, out):
    rec.copy(ins[0], out)
    _acc(rec, out, ins[1])


def _twice_fwd(rec, node, ins, out):
    rec.copy(ins[0], out)
    _acc(rec, out, ins[0])


def _sumsq_infer(ins, attrs):
    return TensorType((), ins[0].dtype)


def ensure_registered():
    if "vk_test_add" in OPS:
        return
    both = frozenset({"f32", "f16"})
    # its gradient goes through an op whose lowering runs in f32 only: an f16 step is refused for it
    register(Op("vk_test_copy32", (Arg("x"),), _same, lambda ins, at: ins[0].copy(),
                lambda g, ins, out, at: [g], doc="test op: x, lowered in f32 only", grad=lambda g, ins, out, at: [g]))
    register_lowering("vk_test_copy32", Lowering(lambda rec, node, ins, out: rec.copy(ins[0], out), frozenset({"f32"})),
                      replace=True)
    register(Op("vk_test_add", (Arg("a"), Arg("b")), _same, lambda ins, at: ins[0] + ins[1],
                lambda g, ins, out, at: [g, g], doc="test op: a + b, same shapes",
                grad=lambda g, ins, out, at: [g.e.op("vk_test_copy32", g)] * 2))
    register_lowering("vk_test_add", Lowering(_add_fwd, both), replace=True)
    register(Op("vk_test_twice", (Arg("x"),), _same, lambda ins, at: ins[0] * 2,
                lambda g, ins, out, at: [g * 2], doc="test op: 2 x", grad=lambda g, ins, out, at: [g * 2.0]))
    register_lowering("vk_test_twice", Lowering(_twice_fwd, both), replace=True)
    # no lowering: the Vulkan kernels run it on numpy, and the planner refuses the graph path for it
    register(Op("vk_test_sumsq", (Arg("x"),), _sumsq_infer, lambda ins, at: np.sum(ins[0] * ins[0]),
                lambda g, ins, out, at: [2 * g * ins[0]], doc="test op: sum of squares, numpy only",
                grad=lambda g, ins, out, at: [g.expand(ins[0].shape) * (2.0 * ins[0])]))


def _add3_fwd(rec, node, ins, out):
    rec.copy(ins[0], out)
    _acc(rec, out, ins[1])
    _acc(rec, out, ins[2])


def ensure_add3():
    """a + b + c: three gradients that are its incoming one."""
    ensure_registered()
    if "vk_test_add3" not in OPS:
        register(Op("vk_test_add3", (Arg("a"), Arg("b"), Arg("c")), _same, lambda ins, at: ins[0] + ins[1] + ins[2],
                    lambda g, ins, out, at: [g, g, g], doc="test op: a + b + c",
                    grad=lambda g, ins, out, at: [g, g, g]))
        register_lowering("vk_test_add3", Lowering(_add3_fwd), replace=True)


class ConstantSGD:
    """The optimizer protocol with a constant learning rate: the numpy update
    and the graph-path update (axpy: p += -lr * g) must agree."""

    def __init__(self, lr=0.1):
        self.lr = lr

    def init_state(self, params):
        return {name: {} for name in params}

    def update(self, params, grads, state, step, iteration):
        for name in params:
            params[name] -= self.lr * grads[name]

    def hyper(self, step, iteration):
        return np.array([self.lr], np.float32)

    def record(self, rec, params, grads, state, hyper):
        for name, p in params.items():
            rec.dispatch("axpy", [p, grads[name]], push=[p.size, -self.lr], groups=grid(p.size),
                         variant="f16" if p.dtype == "f16" else None)


@contextlib.contextmanager
def registered():
    """The test ops, for the duration of a test module: other modules check
    that every registered op is a documented one."""
    ensure_registered()
    ensure_add3()
    try:
        yield
    finally:
        for name in [n for n in OPS if n.startswith("vk_test_")]:
            del OPS[name]
