"""Calls to ops and initialisers, for the Builder: a call's arguments bound
to the callee's signature, tensor operands (a number becomes a const),
attrs checked against their types, and the node typed by its op's rule.
`NodeBuilder` is what an op's `expand` hook gets to add nodes of its own."""
from __future__ import annotations

import inspect
import math
import numbers

import numpy as np

from flowgrad.binder import NO, REQUIRED, BindError, Signature, accept, suggest, type_words
from flowgrad.dsl import ast, limits
from flowgrad.dsl.scope import Scope, Tensor
from flowgrad.dsl.values import DType, is_number, show
from flowgrad.dtypes import LARGEST, as_dtype
from flowgrad.errors import FlowError
from flowgrad.graph import Span, TensorType
from flowgrad.initializers import INITIALISERS
from flowgrad.ops import OPS, Arg, OpTypeError
from flowgrad.ops.registry import Composer


class Calls:
    """The Builder's call binding (a mixin: it uses the Builder's error,
    span, value and graph)."""

    def call_args(self, c: ast.Call, scope: Scope):
        pos_args = [(self.single(a, scope), a.pos) for a in c.args]
        kwargs = {k.name: (self.single(k.value, scope), k.pos) for k in c.kwargs}
        return pos_args, kwargs

    def initialiser(self, call: ast.Call, scope: Scope) -> tuple[str, dict]:
        fn = INITIALISERS.get(call.func)
        if fn is None:
            raise self.error(f"unknown initialiser {call.func!r}{suggest(call.func, INITIALISERS)}", call.func_pos,
                             scope, hint=f"initialisers: {', '.join(f'{n}()' for n in INITIALISERS)}")
        names = list(inspect.signature(fn).parameters)[3:]  # after (rng, shape, fans)
        try:
            given = Signature([(n, None) for n in names]).bind(call.args, {k.name: k.value for k in call.kwargs})
        except BindError as err:
            if err.kind == "too-many":
                raise self.error(f"{call.func}() takes {len(names)} argument{'s' * (len(names) != 1)}, "
                                 f"got {len(call.args)}", call.args[err.index].pos, scope) from None
            if err.kind == "unknown":
                raise self.error(f"{call.func}() has no argument {err.name!r}{suggest(err.name, names)}",
                                 self.kwarg_pos(call, err.name), scope,
                                 hint=f"{call.func}() takes: {', '.join(names) or 'no arguments'}") from None
            raise self.error(f"{call.func}() got two values for {err.name!r}", self.kwarg_pos(call, err.name),
                             scope) from None
        kwargs, where = {}, {}
        for name, expr in given.items():
            if expr is None:
                continue  # not given: the initialiser's own default
            v = self.value(expr, scope)
            if not is_number(v):
                raise self.error(f"{call.func}(): {name} must be a number, got {self.show_value(v)}", expr.pos, scope)
            kwargs[name], where[name] = float(v), expr.pos
        self.check_initialiser_ranges(call, kwargs, where, scope)
        return (call.func, kwargs)

    def check_initialiser_ranges(self, call: ast.Call, kwargs: dict, where: dict, scope: Scope):
        """What numpy's samplers refuse: a negative std or gain, low above
        high. They test the sign bit, so -0.0 is negative, and so is high -
        low = -0.0 (low 0.0, high -0.0)."""
        for name in ("std", "gain"):
            if math.copysign(1.0, kwargs.get(name, 0.0)) < 0:
                note = " (numpy's sampler takes -0.0 for negative: write 0.0)" if kwargs[name] == 0 else ""
                raise self.error(f"{call.func}(): {name} must be >= 0, got {kwargs[name]!r}{note}", where[name], scope)
        if call.func == "uniform":
            defaults = inspect.signature(INITIALISERS["uniform"]).parameters
            low, high = (kwargs.get(k, defaults[k].default) for k in ("low", "high"))
            if math.copysign(1.0, high - low) < 0:
                note = " (numpy's sampler takes high - low = -0.0 for negative)" if low == high else ""
                raise self.error(f"uniform(): low must be <= high, got low={low!r}, high={high!r}{note}", call.pos,
                                 scope)

    @staticmethod
    def kwarg_pos(call: ast.Call, name: str) -> ast.Pos:
        return next((k.pos for k in call.kwargs if k.name == name), call.pos)

    def bind(self, callee: str, args: tuple[Arg, ...], pos_args, kwargs, call_pos, scope) -> dict:
        """Match a call's arguments to a signature, Python-style. Returns
        {arg name: (value, pos)} with defaults filled in as (default, None);
        a variadic arg gets ([values], pos of the first)."""
        variadic = next((a.name for a in args if a.kind == "tensors"), None)
        sig = Signature([(a.name, REQUIRED if a.default is REQUIRED else (a.default, None)) for a in args],
                        variadic=variadic)
        try:
            slots = sig.bind(pos_args, kwargs)
        except BindError as err:
            names = [a.name for a in args]
            shown = f"signature: {signature(callee, args)}"
            if err.kind == "too-many":
                n = err.limit
                raise self.error(f"{callee}() takes {n} positional argument{'s' * (n != 1)} "
                                 f"but {len(pos_args)} were given", pos_args[err.index][1], scope,
                                 hint=shown) from None
            if err.kind == "unknown":
                raise self.error(f"{callee}() has no argument {err.name!r}{suggest(err.name, names)}",
                                 kwargs[err.name][1], scope, hint=shown) from None
            if err.kind == "twice":
                raise self.error(f"{callee}() got two values for argument {err.name!r}", kwargs[err.name][1],
                                 scope) from None
            raise self.error(f"{callee}() is missing its argument {err.name!r}", call_pos, scope,
                             hint=shown) from None
        if variadic is not None:
            items = slots[variadic]
            if not items:
                raise self.error(f"{callee}() is missing its argument {variadic!r}", call_pos, scope,
                                 hint=f"signature: {signature(callee, args)}")
            slots[variadic] = ([v for v, _ in items], items[0][1])
        return slots

    def apply_op(self, op_name: str, pos_args, kwargs, call_pos, scope, shown: str | None = None) -> Tensor:
        """shown: how messages name the callee, e.g. "'*'" for an infix operator."""
        op = OPS.get(op_name)
        if op is None:
            raise self.error(f"unknown op {op_name!r}{suggest(op_name, OPS)}", call_pos, scope)
        slots = self.bind(op_name, op.args, pos_args, kwargs, call_pos, scope)
        given = [slots[a.name][0] for a in op.args if a.kind != "attr"]
        # a number takes the dtype of the data it meets, not of a condition or
        # index argument: where(mask_i32, x, 0.0) is an f32 where
        data = [v for k, v in enumerate(given) if k not in op.nondiff]
        like = next((self.node_type(v).dtype for v in (*_flat(data), *_flat(given)) if isinstance(v, Tensor)), None)
        if like == "i32" and data and not any(isinstance(v, Tensor) for v in _flat(data)):
            # only an i32 condition or index to go by: numbers keep their own
            # dtype, so where(mask_i32, 1.0, 0.0) is an f32 where, not an error
            like = None
        ins, attr_values = [], {}
        for arg in op.args:
            value, pos = slots[arg.name]
            pos = pos or call_pos
            if arg.kind == "attr":
                attr_values[arg.name] = self.attr_value(op_name, arg, value, pos, scope)
            elif arg.kind == "tensor":
                if value is None and arg.default is None:
                    ins.append(None)  # an optional tensor that was not given: left out below
                    continue
                ins.append(self.as_tensor(shown or f"{op_name}()", arg.name, value, like, pos, scope).id)
            else:
                items = value if value is not None else []
                if isinstance(items, list) and len(items) == 1 and isinstance(items[0], list):
                    items = items[0]  # concat([a, b]) as well as concat(a, b)
                if not isinstance(items, (list, tuple)):
                    items = [items]
                ins += [self.as_tensor(f"{op_name}()", arg.name, v, like, pos, scope).id for v in items]
        ins = _given(ins, op_name, op.expand is not None)
        span = self.span(call_pos, scope)
        if self.mixed and self.autocasts(op, ins):
            ins = [self.mixed_cast(i, span) if i is not None and self.graph.nodes[i].dtype == self.dtype else i
                   for i in ins]
        if op.expand is not None:
            if None not in ins:   # (with a gap, the hook reads the inputs by position and checks them)
                self.infer_type(op_name, ins, attr_values, span)  # the rule sees bad shapes before the hook does
            nb = NodeBuilder(self, span)
            try:
                ins, attr_values = op.expand(nb, list(ins), dict(attr_values))
            except OpTypeError as err:
                raise FlowError(op_message(op_name, err), span) from None
        if op.decompose is not None:
            # the op's own checks first, then its composition goes in the graph
            self.infer_type(op_name, ins, attr_values, span)
            nb = NodeBuilder(self, span)
            emit = Composer(nb.apply, lambda i: nb.type(i).shape, lambda i: nb.type(i).dtype, nb.const)
            return Tensor(op.decompose(emit, list(ins), attr_values))
        return Tensor(self.add_node(op_name, ins, attr_values, span).id)

    def autocasts(self, op, ins) -> bool:
        """Whether dtype="mixed" runs the op on f32 copies of its 16-bit inputs:
        a loss always; an arithmetic op only where its operands mix 16-bit and
        f32 (an f32 loss plus an f16 regulariser, in a model that declares
        only f32), as PyTorch promotes them under autocast."""
        if op.autocast == "promote":
            return {self.graph.nodes[i].dtype for i in ins} == {self.dtype, "f32"}
        return op.autocast == "f32"

    def mixed_cast(self, i: int, span: Span) -> int:
        self.mixed_casts += 1
        return self.add_node("cast", [i], {"dtype": "f32"}, span).id

    def add_node(self, op_name: str, ins, attr_values: dict, span: Span):
        out = self.infer_type(op_name, ins, attr_values, span)
        return self.graph.add(op_name, ins, out, attrs=attr_values, span=span)

    def infer_type(self, op_name: str, ins, attr_values: dict, span: Span) -> TensorType:
        op = OPS[op_name]
        in_types = [self.graph.nodes[i].type for i in ins]
        try:
            out = op.infer(in_types, attr_values)
        except OpTypeError as err:
            raise FlowError(op_message(op_name, err), span) from None
        except (ValueError, TypeError, IndexError, KeyError) as err:  # a shape rule's own bug
            raise FlowError(f"{op_name}: internal error in the op's shape rule for "
                            f"{', '.join(map(str, in_types))}: {type(err).__name__}: {err}", span) from None
        problem = limits.type_problem(out.shape)
        if problem:
            raise FlowError(f"{op_name}: {problem}", span)
        return out

    def as_tensor(self, callee, arg_name, value, like, pos, scope) -> Tensor:
        """A tensor argument; a number literal becomes a 0-d const of the
        other operand's dtype (`x * 0.5`, `1 - p`)."""
        if isinstance(value, Tensor):
            return value
        what = f"an operand of {callee}" if callee.startswith("'") else f"{callee}: argument {arg_name!r}"
        if not is_number(value):
            raise self.error(f"{what} must be a tensor or a number, got {self.show_value(value)}", pos, scope)
        dtype = self.literal_dtype(what, value, like, pos, scope)
        return Tensor(self.const(as_dtype(value, dtype), dtype, self.span(pos, scope)))

    def literal_dtype(self, what, value, like, pos, scope, verb: str = "meets") -> str:
        """The dtype a number literal takes: `like` (the tensor it meets, or
        the one it fills), else the compile dtype for a float and i32 for an
        int; an error where the dtype cannot hold it."""
        dtype = like or (self.dtype if isinstance(value, float) else "i32")
        if dtype == "i32" and not isinstance(value, numbers.Integral):
            raise self.error(f"{what} is the float {show(value)}, but the tensor it {verb} is i32",
                             pos, scope, hint="cast the tensor first, e.g. cast(x, f32)" if verb == "meets" else None)
        if dtype == "i32" and not -2**31 <= value < 2**31:
            raise self.error(f"{what} is {show(value)}, outside the range of the i32 tensor it {verb}", pos, scope)
        largest = LARGEST.get(dtype, math.inf)
        if abs(value) > largest:
            # it would be an inf (a mask's `(1 - m) * -1e9` in f16, then 0 * -inf = NaN)
            raise self.error(f"{what} is {show(value)}, outside the range of the {dtype} tensor it {verb} "
                             f"(largest {largest:g})", pos, scope,
                             hint="under dtype f16 or mixed an f32 tensor is f16: use a value within "
                                  f"{largest:g} (e.g. -3e4 for a mask's fill)" if dtype == "f16" else None)
        return dtype

    def const(self, array: np.ndarray, dtype: str, span: Span) -> int:
        array = as_dtype(array, dtype)
        return self.graph.add("const", (), TensorType(tuple(array.shape), dtype), attrs={"value": array},
                              span=span).id

    def attr_value(self, callee: str, arg: Arg, value, pos, scope):
        if isinstance(value, Tensor) or _has_tensor(value):
            raise self.error(f"{callee}(): argument {arg.name!r} must be a constant, not a tensor", pos, scope)
        if not arg.types:
            return _plain(value)
        ok = accept(arg.types, value)
        if ok is NO:
            raise self.error(f"{callee}(): argument {arg.name!r} must be {type_words(arg.types)}, "
                             f"got {self.show_value(value)}", pos, scope)
        return _plain(ok)


class NodeBuilder:
    """What an op's `expand` hook gets: add consts and op nodes at the span of
    the call being built."""

    def __init__(self, builder: Calls, span: Span):
        self._b = builder
        self.span = span
        self.graph = builder.graph

    def type(self, node_id: int) -> TensorType:
        return self.graph.nodes[node_id].type

    @property
    def float_dtype(self) -> str:
        """The float dtype the model is compiled for (f16 or bf16 under mixed)."""
        return self._b.dtype

    def const(self, array, dtype: str) -> int:
        return self._b.const(array, dtype, self.span)

    def apply(self, op_name: str, input_ids, attrs: dict | None = None) -> int:
        return self._b.add_node(op_name, list(input_ids), OPS[op_name].with_defaults(attrs), self.span).id

    def hidden_input(self, name: str, type: TensorType) -> int:
        """The graph's input `name` that the session feeds itself (not a
        user input: not in graph.inputs), created on first use."""
        for node in self.graph.nodes:
            if node.op == "input" and node.name == name:
                return node.id
        return self.graph.add("input", [], type, name=name, span=self.span).id

    def next_id(self) -> int:
        """The id the node being built gets in the model's f32 build (a random
        op's default stream): so f32, f16 and mixed draw the same numbers."""
        return len(self.graph.nodes) - self._b.mixed_casts



def _given(ins: list, op_name: str, expands: bool) -> list:
    """The inputs without the optional tensors not given at the end. One not
    given before one that is stays a None, for the op's expand hook to read
    the inputs by position (attention's mask before its key_padding_mask);
    the hook leaves no gap in the node it builds."""
    while ins and ins[-1] is None:
        ins = ins[:-1]
    if None in ins and not expands:
        raise FlowError(f"{op_name}: an optional tensor argument is given after one that is not, and the op "
                        "has no expand hook to place it")
    return ins


def _plain(v):
    """Attrs hold plain Python values: DType -> str, lists of those."""
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    if isinstance(v, DType):
        return str(v)
    return v


def _has_tensor(v) -> bool:
    return isinstance(v, Tensor) or (isinstance(v, list) and any(_has_tensor(x) for x in v))


def _flat(vs):
    for v in vs:
        if v is None:
            continue
        if isinstance(v, list):
            yield from _flat(v)
        else:
            yield v


def op_message(op_name: str, err: Exception) -> str:
    text = str(err)
    return text if text.startswith(f"{op_name}:") else f"{op_name}: {text}"


def signature(callee: str, args) -> str:
    parts = []
    for a in args:
        text = f"{a.name}..." if a.kind == "tensors" else a.name
        if a.default is not REQUIRED and a.kind != "tensors":
            text += f"={show(a.default)}"
        parts.append(text)
    return f"{callee}({', '.join(parts)})"

