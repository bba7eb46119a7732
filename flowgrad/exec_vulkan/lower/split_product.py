"""Lowerings of the planner's split product and its parts (exec_vulkan/fusion.py):
`matmul_parts` computes a @ b with b's columns cut into k equal blocks,
laid out block-major ([k, ..., n/k]), so each block is one contiguous
`part`, a view the memory plan places inside the product (no copy either
way: the parts' consumers read it in place and write their gradients into
the product's gradient in place).

The product is one batched GEMM each way over the k blocks, on the matmul
kernels (lower/linalg.py's gemm): forward and db keep the block as a batch
dim (b's block z starts z * n/k columns in), da sums it."""
from __future__ import annotations

import math

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.lower.generic import in_place
from flowgrad.exec_vulkan.lower.linalg import Operand, gemm
from flowgrad.exec_vulkan.lowering import FLOATS, Lowering, register_lowerings


def _gemm(rec, *args):
    if not gemm(rec, *args):
        raise DeviceError("internal error: a split product's blocks did not map to one batch dim")


def parts_forward(rec, node, ins, out):
    a, b = ins
    if len(b.shape) != 2 or len(a.shape) < 2:
        raise DeviceError(f"a split product takes a [.., m, k] @ [k, n] product, not {list(a.shape)} @ {list(b.shape)}")
    k, m, kk = node.attrs["parts"], math.prod(a.shape[:-1]), a.shape[-1]
    w = b.shape[-1] // k
    # C[z] = A @ B[:, z*w:(z+1)*w]
    _gemm(rec, Operand(a, kk, 1, (0,)), Operand(b, k * w, 1, (w,)), Operand(out, w, 1, (m * w,)),
          m, w, kk, (k,), (False,))


def _grad_a(rec, g, b, da):
    """da = sum_z g[z] @ B[:, block z]^T"""
    k, w = g.shape[0], g.shape[-1]
    m, kk = math.prod(g.shape[1:-1]), b.shape[0]
    _gemm(rec, Operand(g, w, 1, (m * w,)), Operand(b, 1, k * w, (w,)), Operand(da, kk, 1, (0,)), m, kk, w, (k,), (True,))


def _grad_b(rec, a, g, db):
    """db[:, block z] = a^T @ g[z]"""
    k, w = g.shape[0], g.shape[-1]
    m, kk = math.prod(g.shape[1:-1]), a.shape[-1]
    _gemm(rec, Operand(a, 1, kk, (0,)), Operand(g, w, 1, (m * w,)), Operand(db, k * w, 1, (w,)), kk, w, m, (k,), (False,))


def part_offset(node, in_shape) -> int:
    """Where part `index` starts inside its [k, ...] source, in elements."""
    return node.attrs["index"] * math.prod(in_shape[1:])


register_lowerings({"matmul_parts": Lowering(parts_forward, FLOATS),
    "parts_grad_a": Lowering(lambda rec, node, ins, out: _grad_a(rec, *ins, out), FLOATS),
    "parts_grad_b": Lowering(lambda rec, node, ins, out: _grad_b(rec, *ins, out), FLOATS),
    "part": in_place(part_offset)})
