"""Subscripts `x[i, a:b:s, ...]` with constant indices, for the Builder,
read as numpy and PyTorch read them: an int picks one position and removes
its axis (negative ints count from the end; out of range is an error), a
slice keeps its axis (its bounds clamped to the axis, as Python's are), `...`
stands for the whole axes the other indices leave, and missing trailing
indices take whole axes.

There is no subscript op: each one lowers to ops every executor, lowering
and exporter already has. A slice of step 1 is a `slice` node; a step s > 1
keeps every s-th position by splitting a window of count * s positions into
[count, s] with a reshape and keeping one column with a `slice` (the window
is padded at its end only where count * s exceeds the axis), then merging
it back; the axes ints remove go in one last reshape. Steps below 1 are
errors, as in PyTorch."""
from __future__ import annotations

import numbers

from flowgrad.dsl import ast
from flowgrad.dsl.scope import Scope, Tensor
from flowgrad.ops import OPS


class Subscripts:
    """The Builder's subscripts (a mixin, like Calls: it uses the Builder's
    error, single, node_type and add_node)."""

    def subscript(self, e: ast.Subscript, scope: Scope) -> Tensor:
        x = self.single(e.value, scope)
        if not isinstance(x, Tensor):
            raise self.error(f"subscripts index tensors, and this is {self.show_value(x)}", e.value.pos, scope)
        ttype = self.node_type(x)
        axes = self._axes(e, ttype, scope)
        span = self.span(e.pos, scope)
        shape = list(ttype.shape)
        for axis, (lo, hi, step, _drop) in enumerate(axes):
            x, shape = self._select(x, shape, axis, lo, hi, step, span)
        kept = [n for n, (*_, drop) in zip(shape, axes) if not drop]
        if len(kept) != len(shape):
            x = self._node("reshape", x, {"shape": kept}, span)
        return x

    def _axes(self, e: ast.Subscript, ttype, scope) -> list[tuple[int, int, int, bool]]:
        """(start, stop, step, removes the axis) for every axis of the tensor."""
        rank = len(ttype.shape)
        ellipses = [i for i in e.indices if isinstance(i, ast.EllipsisIndex)]
        if len(ellipses) > 1:
            raise self.error("a subscript takes at most one '...'", ellipses[1].pos, scope)
        given = [i for i in e.indices if not isinstance(i, ast.EllipsisIndex)]
        if len(given) > rank:
            raise self.error(f"too many indices: {len(given)} for a tensor of rank {rank} ({ttype})",
                             given[rank].pos, scope)
        whole = [None] * (rank - len(given))
        if ellipses:
            at = e.indices.index(ellipses[0])
            indices = list(e.indices[:at]) + whole + list(e.indices[at + 1:])
        else:
            indices = list(e.indices) + whole
        return [self._axis(i, axis, ttype, scope) for axis, i in enumerate(indices)]

    def _axis(self, index, axis: int, ttype, scope) -> tuple[int, int, int, bool]:
        n = ttype.shape[axis]
        if index is None:
            return 0, n, 1, False
        if not isinstance(index, ast.Slice):
            i = self._constant(index, "an index", scope)
            if not -n <= i < n:
                raise self.error(f"index {i} is out of range for axis {axis} of size {n} ({ttype})", index.pos,
                                 scope)
            i %= n
            return i, i + 1, 1, True
        start, stop, step = (None if b is None else self._constant(b, what, scope)
                             for b, what in ((index.start, "a slice's start"), (index.stop, "a slice's stop"),
                                             (index.step, "a slice's step")))
        if step is not None and step < 1:
            raise self.error(f"a slice's step must be positive, got {step}" +
                             (" (PyTorch refuses a negative step too)" if step < 0 else ""), index.step.pos, scope)
        lo, hi, step = slice(start, stop, step).indices(n)
        if len(range(lo, hi, step)) == 0:
            raise self.error(f"this slice selects nothing from axis {axis} of size {n} ({ttype}): tensors have "
                             "no empty axes", index.pos, scope)
        return lo, hi, step, False

    def _constant(self, expr, what: str, scope) -> int:
        value = self.single(expr, scope)
        if isinstance(value, Tensor):
            raise self.error(f"{what} in a subscript must be a constant int, not a tensor", expr.pos, scope,
                             hint="a position computed by the model is picked with embedding(ids, table) "
                                  "(rows) or a one-hot product")
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise self.error(f"{what} in a subscript must be an int, got {self.show_value(value)}", expr.pos, scope)
        return int(value)

    def _select(self, x: Tensor, shape: list, axis: int, lo: int, hi: int, step: int, span):
        """x with positions lo, lo + step, ... below hi of `axis` kept; and its shape."""
        n = shape[axis]
        count = len(range(lo, hi, step))
        if step == 1 or count == 1:
            if (lo, count) == (0, n):
                return x, shape
            x = self._node("slice", x, {"axis": axis, "start": lo, "stop": lo + count}, span)
            return x, shape[:axis] + [count] + shape[axis + 1:]
        # a window of count * step positions, in which the kept ones are column `col` of [count, step]:
        # one that fits in the axis where count * step does, else one padded at its end
        col = max(0, lo + count * step - n)
        if col > lo:
            col = 0
        start, end = lo - col, lo - col + count * step
        if (start, min(end, n)) != (0, n):
            x = self._node("slice", x, {"axis": axis, "start": start, "stop": min(end, n)}, span)
        if end > n:   # the padding is never kept
            x = self._node("pad", x, {"pad": [0, 0] * (len(shape) - 1 - axis) + [0, end - n]}, span)
        x = self._node("reshape", x, {"shape": shape[:axis] + [count, step] + shape[axis + 1:]}, span)
        x = self._node("slice", x, {"axis": axis + 1, "start": col, "stop": col + 1}, span)
        shape = shape[:axis] + [count] + shape[axis + 1:]
        return self._node("reshape", x, {"shape": shape}, span), shape

    def _node(self, op: str, x: Tensor, attrs: dict, span) -> Tensor:
        return Tensor(self.add_node(op, [x.id], OPS[op].with_defaults(attrs), span).id)
