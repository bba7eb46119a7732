"""The lowering of `fused` (a chain of pointwise ops the planner merged,
exec_vulkan/fusion.py) on fused_map.comp.

A chain compiles to a register program of the members' own map ops (their
Lowering.pointwise records), one dispatch computing the chain's value per
element; its scalar constants are the program's own. A chain that starts
with a product is the product with the chain in its store (an epilogue).

Why a program in specialization constants rather than a shader per chain:
the machines flowgrad runs on have no shader compiler (glslc runs at build
time only), while the driver compiles each pipeline with its constants
folded in, so one precompiled kernel becomes a straight-line kernel per
chain (interpreted from push constants, its registers were an array
indexed at run time, in local memory on NVIDIA)."""
from __future__ import annotations

import math

import attrs

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.limits import groups_1d
from flowgrad.exec_vulkan.lower.generic import axis_words, collapse, padded, variant, vector_width
from flowgrad.exec_vulkan.lower.map_reduce import M, broadcast_strides
from flowgrad.exec_vulkan.lower.matmul_kernels import device_family
from flowgrad.exec_vulkan.lowering import FLOATS, LOWERINGS, Lowering, register_lowering

MAX_INPUTS = 4      # fused_map.comp's input bindings (registers 0..3)
MAX_INSTRS = 32     # its program slots (instruction k writes register 4 + k)
MAX_OUTPUTS = 2
MAX_PARAMS = 8
MAX_RANK = 3
# fused_map_vec (fused_map.glsl with FG_VECTORS): a chain whose inputs are all read at the
# element's own index moves 16-byte vectors. GPT-2's mixed step on an H100: its GELU passes (in
# the products family) 0.8 ms less (bench/vector_kernels.py).
VECTOR_MAPS = True
# The dtypes whose chains keep fused_map on a device family. On an H100 (driver 580.159) the f32
# build gives wrong values for x0 * x1 + x2 * x3 then tanh or sigmoid (tanh's series branch taken
# far from 0, sigmoid as 1 - itself: a branch decided by the wrong value), which put an LSTM's
# gradients off by up to 14%; running a vector's elements one at a time and testing the branches'
# signs as bits did not change that, while the f16 and bf16 builds compute the same chains right
# (tests/test_vector_kernels.py's chain of four inputs is the check).
SCALAR_MAPS = {"nvidia": frozenset({"f32"})}


def vector_maps(caps, dtype: str) -> bool:
    """Whether a chain of `dtype` may run on fused_map_vec on this device (VECTOR_MAPS, SCALAR_MAPS)."""
    return VECTOR_MAPS and dtype not in SCALAR_MAPS.get(device_family(caps), ())


class TooLarge(DeviceError):
    """The chain does not fit fused_map.comp's program (the planner then
    fuses less of it)."""


@attrs.frozen
class Program:
    inputs: tuple       # the source each input register reads: ("x", k)
    instrs: tuple       # (map op id, (a, b, c) registers, param slot)
    params: tuple       # float per slot
    outputs: tuple      # the register each output stores


class _Builder:
    """Instructions over symbolic values: ("src", source) or ("ins", j)."""

    def __init__(self):
        self.instrs: list[tuple] = []

    def emit(self, op, operands, param: float):
        if int(op) == int(M.COPY):
            return operands[0]   # a copy is the value itself
        self.instrs.append((int(op), tuple(operands), float(param)))
        return ("ins", len(self.instrs) - 1)

    def finish(self, outputs) -> Program:
        """Dead instructions dropped, registers assigned."""
        live, stack = set(), [v for v in outputs if v[0] == "ins"]
        while stack:
            j = stack.pop()[1]
            if j not in live:
                live.add(j)
                stack += [v for v in self.instrs[j][1] if v[0] == "ins"]
        kept = sorted(live)
        read = [v for j in kept for v in self.instrs[j][1]] + list(outputs)
        sources = list(dict.fromkeys(v[1] for v in read if v[0] == "src"))
        params = list(dict.fromkeys(self.instrs[j][2] for j in kept))
        if len(sources) > MAX_INPUTS or len(kept) > MAX_INSTRS or len(params) > MAX_PARAMS:
            raise TooLarge(f"a fused chain needs {len(sources)} inputs, {len(kept)} instructions and "
                           f"{len(params)} scalars; fused_map takes {MAX_INPUTS}, {MAX_INSTRS} and {MAX_PARAMS}")
        reg = {("src", s): k for k, s in enumerate(sources)}
        reg.update({("ins", j): MAX_INPUTS + k for k, j in enumerate(kept)})
        instrs = tuple((op, tuple(reg[v] for v in operands) + (0,) * (3 - len(operands)), params.index(p))
                       for op, operands, p in (self.instrs[j] for j in kept))
        return Program(tuple(sources), instrs, tuple(params), tuple(reg[v] for v in outputs))


def pointwise_of(op_name: str, attrs):
    """The op's Pointwise record, or None where it is no map op."""
    low = LOWERINGS.get(op_name)
    return low.pointwise(attrs) if low and low.pointwise else None


M.declare(PARAM=60)   # the instruction's scalar: a constant the chain reads (fused_map.comp)


def forward_program(steps, n_in: int, pre: bool = False, consts=()) -> Program:
    """The chain's value; pre: first the value its last step reads (an activation's input).
    consts: (input k, value) for the scalar constants among the inputs, loaded
    as the program's scalars rather than read from their buffers."""
    b = _Builder()
    values = [("src", ("x", k)) for k in range(n_in)]
    for k, value in consts:
        values[k] = b.emit(M.PARAM, [], value)
    for op_name, refs, at in steps:
        pw = pointwise_of(op_name, at)
        values.append(b.emit(pw.op, [values[r] for r in refs], pw.param))
    return b.finish(values[-2:] if pre else values[-1:])


def run_program(rec, prog: Program, sources: dict, outs, space) -> None:
    """outs[i] = the program's output i, per element of `space` (contiguous)."""
    n = math.prod(space)
    if n == 0:
        return
    ins = [sources[s] for s in prog.inputs]
    dims = collapse(space, frozenset(), [broadcast_strides(tuple(v.shape), space) for v in ins])
    if len(dims) > MAX_RANK:
        raise TooLarge(f"a fused chain over {list(space)} with these broadcasts needs {len(dims)} axes; "
                       f"fused_map takes {MAX_RANK}")
    prog_words = padded([op | a << 7 | b << 13 | c << 19 | p << 25 for op, (a, b, c), p in prog.instrs], MAX_INSTRS)
    o = padded(prog.outputs, MAX_OUTPUTS)
    meta = len(dims) | len(ins) << 2 | len(prog.instrs) << 5 | len(outs) << 11 | o[0] << 13 | o[1] << 19
    dtype = outs[0].dtype
    bufs = ins + [rec.stand_in(dtype) for _ in range(MAX_INPUTS - len(ins))]
    bufs += list(outs) + [rec.stand_in(dtype) for _ in range(MAX_OUTPUTS - len(outs))]
    push = [n, *axis_words(dims, MAX_RANK, MAX_INPUTS, fill=1), *padded(prog.params, MAX_PARAMS, 0.0)]
    vw = vector_width(rec, dtype) if vector_maps(rec.caps, dtype) else None
    if vw and len(dims) == 1 and all(s == 1 for s in dims[0][2]):   # every input read at the element's index
        rec.dispatch("fused_map_vec", bufs, push, groups_1d(-(-n // vw)), variant(dtype), spec=(meta, *prog_words))
    else:
        rec.dispatch("fused_map", bufs, push, groups_1d(n), variant(dtype), spec=(meta, *prog_words))


# ---------------------------------------------------------------- a product and the ops after it
# steps[0] is an op whose lowering takes an Epilogue (a matmul), the next
# steps add one input each to the value so far: a residual shaped as the
# value, or a bias over its last axis (at most one of each), and the chain
# may end with an activation (Pointwise.activation). The GEMM's store does
# them where its kernel can, storing the activation's input h beside its
# output: into the node that stands for h where the backward reads it
# (attrs["pre_out"]: the chain's last input), else into scratch.


@attrs.frozen
class EpilogueForm:
    product: tuple          # the product's input positions
    residual: int | None    # input positions of the residual and the bias
    bias: int | None
    bias_first: bool
    act: tuple | None = None   # the activation step, last in the chain


def epilogue_form(steps, in_shapes, out_shape) -> EpilogueForm | None:
    """The chain as a product, its adds and its activation, or None when it is not one."""
    first = LOWERINGS.get(steps[0][0]) if steps else None
    if first is None or not first.epilogue or not 2 <= len(steps) <= 4:
        return None
    n_in = len(in_shapes)
    last = pointwise_of(steps[-1][0], steps[-1][2])   # an activation of the value before it?
    act = steps[-1] if last and last.activation and tuple(steps[-1][1]) == (n_in + len(steps) - 2,) else None
    adds = steps[1:len(steps) - (act is not None)]
    product = tuple(steps[0][1])
    roles: dict[str, int] = {}
    for j, (op_name, refs, at) in enumerate(adds, start=1):
        pw = pointwise_of(op_name, at)
        others = [r for r in refs if r != n_in + j - 1]
        if pw is None or not pw.adds or len(refs) != 2 or len(others) != 1 or others[0] >= n_in:
            return None
        shape = tuple(in_shapes[others[0]])
        role = "residual" if shape == tuple(out_shape) else "bias" if shape == tuple(out_shape[-1:]) else None
        if role is None or role in roles or others[0] in product or others[0] in roles.values():
            return None
        roles[role] = others[0]
    return EpilogueForm(product, roles.get("residual"), roles.get("bias"),
                        list(roles) == ["bias", "residual"], act)


def _epilogue_forward(rec, node, ins, out, form):
    from flowgrad.exec_vulkan.lower.linalg import Epilogue
    from flowgrad.exec_vulkan.lower.matmul_kernels import store_takes_activation

    steps, shape = node.attrs["steps"], tuple(out.shape)
    pre = None if form.act is None else ins[-1] if node.attrs.get("pre_out") else rec.scratch(shape, out.dtype)
    # where the store declines the activation, the product and its adds go to h, the activation after
    apart = pre is not None and not store_takes_activation(rec.caps)
    dst, stored = (pre, attrs.evolve(form, act=None)) if apart else (out, form)
    act = 0 if stored.act is None else int(pointwise_of(form.act[0], form.act[2]).op)
    epi = Epilogue(None if form.residual is None else ins[form.residual],
                   None if form.bias is None else ins[form.bias], form.bias_first, act=act,
                   pre=None if apart else pre)
    op_name, refs, at = steps[0]
    product = attrs.evolve(node, op=op_name, inputs=tuple(node.inputs[r] for r in refs), attrs=at)
    LOWERINGS[op_name].forward(rec, product, [ins[r] for r in refs], dst, epilogue=epi)
    if not epi.applied and len(steps) > 1:   # the product is in dst: the rest in place, in one pass
        srcs = list(ins) + [dst]
        prog = forward_program(steps[1:], len(srcs), pre=pre is not None)
        run_program(rec, prog, {("x", k): v for k, v in enumerate(srcs)}, [out] if pre is None else [pre, out], shape)
    elif apart:   # h is in pre: the activation alone, a chain of its own of one input
        op_name, _refs, at = form.act
        run_program(rec, forward_program(((op_name, (0,), at),), 1), {("x", 0): pre}, [out], shape)


def _form(node, ins, out):
    return epilogue_form(node.attrs["steps"], [tuple(v.shape) for v in ins], tuple(out.shape))


def forward(rec, node, ins, out):
    if node.attrs.get("written_by", -1) >= 0:
        return   # an activation's input, stored by the chain that ends with the activation
    form = _form(node, ins, out)
    if form is not None:
        _epilogue_forward(rec, node, ins, out, form)
    else:
        prog = forward_program(node.attrs["steps"], len(ins), consts=node.attrs.get("consts", ()))
        run_program(rec, prog, {("x", k): v for k, v in enumerate(ins)}, [out], tuple(out.shape))


register_lowering("fused", Lowering(forward, FLOATS))
