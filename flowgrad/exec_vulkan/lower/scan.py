"""Lowerings of `scan` and `unpack` (flowgrad/ops/scan.py).

A scan records its cell's nodes through their own forward lowerings once
per step, as one node's section: the step's x_t are views into the
time-major sequences, its y_t and carries are written straight into their
places in the packed result (step t's window), and the next step reads its
carries where the last one wrote them. Only the values inside one step are
scratch, released after each step. So the dispatch count grows with the
steps, the cell's kernels are the ones the model's own nodes run, and the
whole scan stays inside the step's one submit.

A scan records no backward of its own: its grad rule (a scan of the cell's
backward, run the other way) is recorded through the forward lowerings
(lower/derived.py), this one included.

`unpack` is a window of the packed value: the memory plan places it there
(a view), so it copies only when it lies elsewhere."""
from __future__ import annotations

import math

import attrs

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.lower.spatial import fill_word
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, FLOATS, Lowering, register_lowering
from flowgrad.graph import fill_value
from flowgrad.ops import get_op
from flowgrad.ops.scan import layout


def _cell_lowerings(node, body) -> dict:
    """{body node id: its lowering}, each checked as the planner checks a
    model's node: a lowering that takes its dtypes, and index checks where
    the cell reads indices (a cell's inputs are never range-checked on the host)."""
    from flowgrad.exec_vulkan.lower import lowering_for

    graph, lows = body.graph, {}
    for n in graph.nodes:
        if n.op in ("input", "const"):
            continue
        low = lowering_for(n.op)
        where = n.span.short() if n.span else "?"
        if low is None:
            raise DeviceError(f"the cell's {n.label} = {n.op}(...) at {where} has no graph lowering")
        dtypes = {n.dtype} | {graph.nodes[i].dtype for i in n.inputs}
        if not dtypes <= low.dtypes:
            raise DeviceError(f"the cell's {n.op} at {where} has no {', '.join(sorted(dtypes - low.dtypes))} "
                              f"lowering (accepts {', '.join(sorted(low.dtypes))})")
        if get_op(n.op).index_bounds is not None and not low.checks_indices:
            raise DeviceError(f"the cell's {n.op} at {where} reads indices, and its lowering does not check them")
        lows[n.id] = low
    return lows


def _recorded(node, body, n):
    """Body node n as the lowerings see it: an id of its own (what a lowering
    keeps is keyed by it), reading the scan node (an index it flags names
    the scan; its span names the cell's line)."""
    return attrs.evolve(n, id=(node.id, id(body), n.id), inputs=(node.id,) * len(n.inputs))


def _constants(rec, body) -> dict:
    """The cell's constants, filled once for every step."""
    out = {}
    for n in body.graph.nodes:
        if n.op != "const":
            continue
        value = fill_value(n.attrs["value"])
        if value is None:
            raise DeviceError(f"the cell's constant {n.label} is not one number everywhere")
        out[n.id] = rec.scratch(n.shape, n.dtype)
        rec.fill(out[n.id], fill_word(value, n.dtype))
    return out


def _in_place(low, n, src):
    """The window of src a view node (a reshape, a slice of leading axes) is, or None."""
    if low.view is None or src.dtype != n.dtype:
        return None
    offset = low.view(n, tuple(src.shape))
    return None if offset is None else src.view(offset, n.shape)


def scan_forward(rec, node, ins, out):
    body, steps, reverse, history = (node.attrs[k] for k in ("body", "steps", "reverse", "history"))
    lows = _cell_lowerings(node, body)
    cell = {k: _recorded(node, body, body.graph.nodes[k]) for k in lows}
    consts = _constants(rec, body)
    xs, carries, captured = body.split(ins)
    where, _ = layout(body, steps, history)
    # without a history, the carries go back and forth between two places until the last step
    spares = None if history else [(rec.scratch(c.shape, c.dtype), rec.scratch(c.shape, c.dtype)) for c in carries]
    for s, i in enumerate(reversed(range(steps)) if reverse else range(steps)):
        top = rec.arena.top
        places = [_place(out, w, k < body.ys or history, i, s, steps, spares and spares[k - body.ys])
                  for k, w in enumerate(where)]
        values = dict(consts)
        values.update(zip(body.inputs, [x.view(i * (x.size // steps), x.shape[1:]) for x in xs] + carries + captured))
        _record_step(rec, body, lows, cell, values, places)
        carries = places[body.ys:]
        rec.arena.top = top   # the next step takes the same scratch


def _place(out, where, per_step: bool, i: int, s: int, steps: int, spare):
    """Where a result of step i (the s-th to run) goes: its window of the
    packed value, or (a carry kept only at the end, before the last step)
    one of its two spares."""
    offset, shape = where
    if per_step:
        return out.view(offset + i * math.prod(shape[1:]), shape[1:])
    return out.view(offset, shape) if s == steps - 1 else spare[s % 2]


def _record_step(rec, body, lows, cell, values, places) -> None:
    """The cell's nodes in order, each written where its result goes (a
    cell output's place, a view's window, else scratch), then the copies
    into the places of outputs that lie elsewhere (a value returned twice,
    or an input returned as it came)."""
    first = {}
    for o, place in zip(body.outputs, places):
        first.setdefault(o, place)
    for n in body.graph.nodes:
        if n.id not in lows:
            continue
        ins = [values[k] for k in n.inputs]
        dst = first.get(n.id)
        if dst is None and ins:
            dst = _in_place(lows[n.id], n, ins[0])
        values[n.id] = dst if dst is not None else rec.scratch(n.shape, n.dtype)
        lows[n.id].forward(rec, cell[n.id], ins, values[n.id])
    for o, place in zip(body.outputs, places):
        if not _same(values[o], place):
            rec.copy(values[o], place)


def _same(a, b) -> bool:
    return a.buffer is b.buffer and a.offset == b.offset


# ---------------------------------------------------------------- unpack

def _unpack_offset(node, in_shape) -> int:
    return node.attrs["offset"]


def unpack_forward(rec, node, ins, out):
    (x,) = ins
    src = x.reshape((x.size,)).view(node.attrs["offset"], out.shape)
    if not _same(src, out):   # the memory plan put it elsewhere: copy the window
        rec.copy(src, out)


def unpack_backward(rec, node, g, ins, out, grads):
    dx = grads[0]
    if dx is None:
        return
    rec.fill(dx, 0)
    rec.copy(g, dx.reshape((dx.size,)).view(node.attrs["offset"], g.shape))


register_lowering("scan", Lowering(scan_forward, None, ALL_DTYPES))
register_lowering("unpack", Lowering(unpack_forward, unpack_backward, ALL_DTYPES, FLOATS, view=_unpack_offset))
