"""einsum, as torch.einsum: built, when the model is, from the ops that
already exist (permute, reshape, broadcast_to, sum, matmul, and pad and
slice for a repeated subscript's diagonal), so every backend runs it and
its gradient with no kernel of its own.

The operands are contracted left to right, two at a time, each pair as one
batched matmul: the subscripts both share and the result keeps are its
batch, those both share and nothing later reads are its inner dimension.
A subscript only one operand has, which nothing later reads, is summed out
first; a repeated one (`ii->i`) takes the diagonal. A subscript of size 1
broadcasts against the same subscript of another size, as in PyTorch."""
from __future__ import annotations

import math
import string

from flowgrad.ops.define import defop
from flowgrad.ops.emit import composition
from flowgrad.ops.registry import Arg, OpTypeError, Sample
from flowgrad.ops.rules import float_dtype, same_dtype

LETTERS = frozenset(string.ascii_letters)


class Spec:
    """An equation read against its operands' shapes: the labels of each
    operand's axes and of the output, and each label's size. A label is a
    subscript letter, or ("...", k) for the k-th axis of the ellipsis
    counted from the right (ellipsis axes broadcast right-aligned)."""

    def __init__(self, equation: str, shapes):
        text = "".join(equation.split())
        lhs, arrow, rhs = text.partition("->")
        terms = lhs.split(",")
        if len(terms) != len(shapes):
            raise OpTypeError(f"equation {equation!r} has {len(terms)} operand{'s' * (len(terms) != 1)}, but "
                              f"{len(shapes)} tensor{'s were' if len(shapes) != 1 else ' was'} given")
        self.ins = [self._term(t, shape, k) for k, (t, shape) in enumerate(zip(terms, shapes))]
        self.sizes = self._sizes(shapes)
        ellipsis = sorted({lab for labels in self.ins for lab in labels if isinstance(lab, tuple)}, key=lambda l: -l[1])
        if arrow:
            self.out = self._output(rhs, ellipsis)
        else:   # implicit: the ellipsis, then the letters used once, in order (uppercase first)
            letters = [lab for labels in self.ins for lab in labels if isinstance(lab, str)]
            self.out = ellipsis + sorted(lab for lab in set(letters) if letters.count(lab) == 1)

    @staticmethod
    def _letters(term: str, where: str) -> None:
        bad = next((c for c in term.replace("...", "") if c not in LETTERS), None)
        if bad is not None:
            raise OpTypeError(f"{where} hold {bad!r}: subscripts are letters a-z, A-Z, and one '...' at most")
        if term.count("...") > 1:
            raise OpTypeError(f"{where} hold more than one '...'")

    def _term(self, term: str, shape, k: int) -> list:
        self._letters(term, f"operand {k}'s subscripts {term!r}")
        head, dots, tail = term.partition("...")
        named = len(head) + len(tail)
        if named > len(shape) or (not dots and named != len(shape)):
            raise OpTypeError(f"operand {k}'s subscripts {term!r} name {named} ax{'es' if named != 1 else 'is'}, "
                              f"but operand {k} has shape {list(shape)}"
                              + ("" if dots else " (an ellipsis '...' stands for the others)"))
        rest = len(shape) - named
        return list(head) + [("...", rest - 1 - i) for i in range(rest)] * bool(dots) + list(tail)

    def _sizes(self, shapes) -> dict:
        sizes: dict = {}
        for k, (labels, shape) in enumerate(zip(self.ins, shapes)):
            for lab, n in zip(labels, shape):
                if labels.count(lab) > 1 and n != shape[labels.index(lab)]:
                    raise OpTypeError(f"subscript {lab} repeats in operand {k} with sizes "
                                      f"{shape[labels.index(lab)]} and {n}: its diagonal needs one size")
                seen = sizes.get(lab, 1)
                if n != 1 and seen != 1 and n != seen:
                    name = "an ellipsis axis" if isinstance(lab, tuple) else f"subscript {lab}"
                    raise OpTypeError(f"{name} has size {n} in operand {k} and {seen} before it (sizes must be "
                                      "equal, or 1 to broadcast)")
                sizes[lab] = max(seen, n)
        return sizes

    def _output(self, rhs: str, ellipsis: list) -> list:
        self._letters(rhs, f"the output subscripts {rhs!r}")
        head, dots, tail = rhs.partition("...")
        for c in head + tail:
            if (head + tail).count(c) > 1:
                raise OpTypeError(f"the output subscripts {rhs!r} name {c} twice")
            if c not in self.sizes:
                raise OpTypeError(f"the output subscript {c} is no operand's subscript")
        return list(head) + ellipsis * bool(dots) + list(tail)


def _check(ins, attrs):
    same_dtype(ins, "the operands")
    float_dtype(ins[0], "operands")
    Spec(attrs["equation"], [t.shape for t in ins])


def _permute(x, perm):
    return x if list(perm) == sorted(perm) else x.e.op("permute", x, dims=list(perm))


def _diagonal(x, labels):
    """The first repeated label's diagonal: its two axes moved last,
    flattened to n*n, padded to n*(n+1) and read as rows of n+1, whose
    first column is the diagonal."""
    lab = next(lab for lab in labels if labels.count(lab) > 1)
    first = labels.index(lab)
    second = labels.index(lab, first + 1)
    rest = [d for d in range(len(labels)) if d not in (first, second)]
    x = _permute(x, rest + [first, second])
    shape, n = list(x.shape[:len(rest)]), x.shape[-1]
    x = x.e.op("pad", x.reshape(shape + [n * n]), pad=[0, n])
    x = x.e.op("slice", x.reshape(shape + [n, n + 1]), axis=-1, start=0, stop=1)
    return x.reshape(shape + [n]), [labels[d] for d in rest] + [lab]


def _sum_out(x, labels, keep):
    axes = [d for d, lab in enumerate(labels) if lab not in keep]
    return (x.sum(axis=axes), [lab for lab in labels if lab in keep]) if axes else (x, labels)


def _contract(a, la, b, lb, keep):
    """a and b (their own labels each, none repeated, none that only one
    of them has and nothing keeps) as one matmul: [batch, m, k] @ [batch, k, n];
    with nothing to contract, a broadcast product."""
    batch = [lab for lab in la if lab in lb and lab in keep]
    inner = [lab for lab in la if lab in lb and lab not in keep]
    rows = [lab for lab in la if lab not in lb]
    cols = [lab for lab in lb if lab not in la]
    size = dict(zip(la, a.shape)) | dict(zip(lb, b.shape))
    if not inner:
        a = _permute(a, [la.index(lab) for lab in batch + rows]).reshape(
            [size[lab] for lab in batch + rows] + [1] * len(cols))
        b = _permute(b, [lb.index(lab) for lab in batch + cols]).reshape(
            [size[lab] for lab in batch] + [1] * len(rows) + [size[lab] for lab in cols])
        return a * b, batch + rows + cols
    dims = [math.prod(size[lab] for lab in group) for group in (batch, rows, inner, cols)]
    lead = dims[:1] if batch else []
    a = _permute(a, [la.index(lab) for lab in batch + rows + inner]).reshape(lead + dims[1:3])
    b = _permute(b, [lb.index(lab) for lab in batch + inner + cols]).reshape(lead + dims[2:])
    return (a @ b).reshape([size[lab] for lab in batch + rows + cols]), batch + rows + cols


def _einsum(e, ins, attrs):
    spec = Spec(attrs["equation"], [x.shape for x in ins])
    terms = []
    for k, (x, labels) in enumerate(zip(ins, spec.ins)):
        while len(set(labels)) < len(labels):
            x, labels = _diagonal(x, labels)
        others = {lab for j, ls in enumerate(spec.ins) if j != k for lab in ls}
        x, labels = _sum_out(x, labels, others | set(spec.out))
        terms.append((x.expand([spec.sizes[lab] for lab in labels]), labels))   # size-1 axes larger elsewhere
    x, labels = terms[0]
    for k, (b, lb) in enumerate(terms[1:], start=1):
        keep = set(spec.out) | {lab for _, ls in terms[k + 1:] for lab in ls}
        x, labels = _sum_out(x, labels, keep | set(lb))
        b, lb = _sum_out(b, lb, keep | set(labels))
        x, labels = _contract(x, labels, b, lb, keep)
    x, labels = _sum_out(x, labels, set(spec.out))
    return _permute(x, [labels.index(lab) for lab in spec.out])


einsum = defop(
    "einsum", (Arg("equation", "attr", types=(str,)), Arg("operands", "tensors")), decompose=composition(_einsum),
    check=_check,
    doc="Einstein summation over the operands' subscripts (\"ij,jk->ik\"; implicit output, '...', a repeated "
        "subscript's diagonal and size-1 broadcasting as torch.einsum), built from permute, reshape, sum and matmul",
    samples=[Sample((((2, 3), "normal"), ((3, 4), "normal")), {"equation": "ij,jk->ik"}),
             Sample((((2, 3, 4), "normal"), ((2, 4, 5), "normal"), ((5,), "normal")),
                    {"equation": "bij,bjk,k->bi"}),
             Sample((((3, 3), "normal"), ((3,), "normal")), {"equation": "ii,i"}),
             Sample((((2, 1, 3), "normal"), ((4, 3), "normal")), {"equation": "...i,...i->..."})])
