"""Lowerings of `scan` and `unpack` (flowgrad/ops/scan.py).

A scan records its cell's nodes through their own forward lowerings once
per step, as one node's section: the step's x_t are views into the
time-major sequences, its y_t and carries are written straight into their
places in the packed result (step t's window), and the next step reads its
carries where the last one wrote them. Only the values inside one step are
scratch, released after each step. So the dispatch count grows with the
steps, the cell's kernels are the ones the model's own nodes run, and the
whole scan stays inside the step's one submit. The cell is recorded as the
planner fused it (fuse_cells: its pointwise chains one dispatch each), what
reads only its params and constants once before the first step, and steps
alike repeat one recorded step's commands (_Repeats).

A scan's gradient is a scan too (its grad rule: a scan of the cell's
backward, run the other way), a node of the step's graph like any other.

`unpack` is a window of the packed value: the memory plan places it there
(a view), so it copies only when it lies elsewhere."""
from __future__ import annotations

import contextlib
import math
import weakref

import attrs

from flowgrad.dtypes import ITEMSIZE
from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.buffers import BufView
from flowgrad.exec_vulkan.lower.generic import in_place, placed_at
from flowgrad.exec_vulkan.lowering import ALL_DTYPES, LOWERINGS, Lowering, register_lowerings
from flowgrad.exec_vulkan.recorder import Copy, Dispatch, Fill, fill_word
from flowgrad.graph import fill_value
from flowgrad.ops import get_op
from flowgrad.ops.scan import invariant, layout

REPEAT_STEPS = True   # steps after the first two repeat their parity's commands (_Repeats); off: each is recorded


# body -> (the graph a step records, the nodes it runs, those recorded once): what
# keep_cell was given for it (the planner's fused cell), else the body's own graph
CELLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def keep_cell(body, graph) -> None:
    """Record `body` as `graph` (its nodes, and the same outputs, by id:
    exec_vulkan/fusion.py's fused cell, a lowering does not call the planner)."""
    runs = frozenset(n.id for n in graph.needed_for(body.outputs))
    CELLS[body] = graph, runs, invariant(graph, body.split(body.inputs)[2], runs)


def _cell_lowerings(graph, runs) -> dict:
    """{id: lowering} of the cell's nodes a step runs, each checked as the
    planner checks a model's node: a lowering that takes its dtypes, and
    index checks where it reads indices (a cell's inputs are never
    range-checked on the host)."""
    lows = {}
    for n in graph.nodes:
        if n.op in ("input", "const") or n.id not in runs:
            continue
        low = LOWERINGS.get(n.op)   # forward lowerings only: the cell's backward is a cell of its own
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


def _constants(rec, graph, runs) -> dict:
    """The cell's constants, filled once for every step."""
    out = {}
    for n in graph.nodes:
        if n.op != "const" or n.id not in runs:
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
    if body not in CELLS:
        keep_cell(body, body.graph)
    graph, runs, fixed = CELLS[body]
    lows = _cell_lowerings(graph, runs)
    # the cell's nodes as the lowerings see them: each an id of its own (what a lowering keeps is
    # keyed by it), reading the scan node (an index it flags names the scan; its span the cell's line)
    cell = {k: attrs.evolve(n, id=(node.id, id(body), k), inputs=(node.id,) * len(n.inputs))
            for k, n in enumerate(graph.nodes) if k in lows}
    xs, carries, captured = body.split(ins)
    values = _constants(rec, graph, runs)
    values.update(zip(body.inputs[body.xs + body.carries:], captured))
    _record(rec, graph, {k: low for k, low in lows.items() if k in fixed}, cell, values, {})
    lows = {k: low for k, low in lows.items() if k not in fixed}
    where, _ = layout(body, steps, history)
    # without a history, the carries go back and forth between two places until the last step
    spares = None if history else [(rec.scratch(c.shape, c.dtype), rec.scratch(c.shape, c.dtype)) for c in carries]
    steps_of = _Repeats(rec, xs, out, [w for k, w in enumerate(where) if k < body.ys or history], steps)
    for s, i in enumerate(reversed(range(steps)) if reverse else range(steps)):
        places = [_place(out, w, k < body.ys or history, i, s, steps, spares and spares[k - body.ys])
                  for k, w in enumerate(where)]
        # the first step reads the initial carries, and without a history the last writes the packed value
        alike = s > 0 and (history or s < steps - 1)
        if not (alike and steps_of.repeat(s % 2, i)):
            # the next step takes the same scratch
            with rec.released(), steps_of.record(s % 2 if alike else None, i):
                step = dict(values)
                step.update(zip(body.inputs, [x.view(i * (x.size // steps), x.shape[1:]) for x in xs] + carries))
                first: dict = {}
                for o, place in zip(body.outputs, places):
                    first.setdefault(o, place)
                _record(rec, graph, lows, cell, step, first)
                for o, place in zip(body.outputs, places):   # a value returned twice, or as it came in
                    if not placed_at(step[o], place):
                        rec.copy(step[o], place)
        carries = places[body.ys:]


class _Repeats:
    """The steps of a scan record the same commands, moved along the
    sequences by whole steps: each step after the first is recorded once
    for each parity (the spares a carry goes back and forth between), and
    the others repeat it with every view into a sequence or a per-step
    result moved by the steps between. Only where the moved views keep
    their alignment (so a dispatch copies the same views to aligned
    scratch), and where the recorded step takes no per-call resources (an
    index check's flag word, a split reduction's counters): else every
    step is recorded."""

    def __init__(self, rec, xs, out, per_step, steps: int):
        self.rec = rec
        # (buffer, first byte, end, bytes per step) of each sequence and each per-step result
        self.regions = [(x.buffer, x.offset, x.offset + x.nbytes, x.nbytes // steps) for x in xs]
        size = ITEMSIZE[out.dtype]
        for offset, shape in per_step:
            lo = out.offset + offset * size
            self.regions.append((out.buffer, lo, lo + math.prod(shape) * size, math.prod(shape[1:]) * size))
        self.on = REPEAT_STEPS and all(stride % rec.align == 0 for *_, stride in self.regions)
        self.recorded: dict = {}   # parity -> (position, commands)

    def repeat(self, parity: int, i: int) -> bool:
        """Step i's commands, moved from the recorded step of its parity; False if there is none."""
        if not self.on or parity not in self.recorded:
            return False
        at, commands = self.recorded[parity]
        self.rec.commands += [self._moved(c, i - at) for c in commands]
        return True

    @contextlib.contextmanager
    def record(self, parity, i: int):
        rec = self.rec
        start, checks, lasting = len(rec.commands), len(rec.checks.checks), rec.arena.lasting.top
        yield
        if parity is None or not self.on:
            return
        if (len(rec.checks.checks), rec.arena.lasting.top) != (checks, lasting):
            self.on = False   # flag words or counters of its own: each step is recorded
            return
        self.recorded[parity] = (i, rec.commands[start:])

    def _moved(self, cmd, steps: int):
        if isinstance(cmd, Dispatch):
            return attrs.evolve(cmd, views=tuple(self._view(v, steps) for v in cmd.views))
        if isinstance(cmd, Fill):
            return attrs.evolve(cmd, view=self._view(cmd.view, steps))
        if isinstance(cmd, Copy):
            return attrs.evolve(cmd, src=self._view(cmd.src, steps), dst=self._view(cmd.dst, steps))
        raise DeviceError(f"internal error: a scan step recorded a {type(cmd).__name__}")

    def _view(self, v, steps: int):
        for buffer, lo, hi, stride in self.regions:
            if v.buffer is buffer and lo <= v.offset < hi:
                return BufView(v.buffer, v.offset + steps * stride, v.shape, v.dtype)
        return v


def _place(out, where, per_step: bool, i: int, s: int, steps: int, spare):
    """Where a result of step i (the s-th to run) goes: its window of the
    packed value, or (a carry kept only at the end, before the last step)
    one of its two spares."""
    offset, shape = where
    if per_step:
        return out.view(offset + i * math.prod(shape[1:]), shape[1:])
    return out.view(offset, shape) if s == steps - 1 else spare[s % 2]


def _record(rec, graph, lows, cell, values, first) -> None:
    """The nodes of `lows` in order, each written where its result goes (its
    place in `first`, the window of a view, else scratch) and kept in values."""
    for n in graph.nodes:
        if n.id not in lows:
            continue
        ins = [values[k] for k in n.inputs]
        dst = first.get(n.id)
        if dst is None and ins:
            dst = _in_place(lows[n.id], n, ins[0])
        values[n.id] = dst if dst is not None else rec.scratch(n.shape, n.dtype)
        lows[n.id].forward(rec, cell[n.id], ins, values[n.id])


def _cell_dtypes(node) -> list[str]:
    """The dtypes a scan's inputs hold: its cell's inputs'."""
    body = node.attrs["body"]
    return [body.graph.nodes[i].dtype for i in body.inputs]


register_lowerings({"scan": Lowering(scan_forward, ALL_DTYPES, cell=_cell_dtypes),
    "unpack": in_place(lambda node, in_shape: node.attrs["offset"])})
