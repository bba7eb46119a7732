"""Op signatures (the contract with the DSL), shape/dtype rules and their
error messages, and a fuzz: for any inputs and attrs, infer either returns
a type or raises OpTypeError, and when it returns one, forward and VJP
produce exactly that type and the inputs' shapes."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgrad.errors import FlowError
from flowgrad.dtypes import NUMPY_DTYPE
from flowgrad.graph import TensorType
from flowgrad import op_table
from flowgrad.ops import BUILTIN, OPS, OpTypeError, get_op

from tests import op_samples, scan_samples

def test_the_docs_op_table_is_generated_from_the_records():
    """docs/language.md's op table is the records' (rewrite: python -m flowgrad.op_table)."""
    assert op_table.main(["--check"]) == 0, "docs/language.md's op table is stale: run `python -m flowgrad.op_table`"


def test_the_docs_op_table_shows_every_builtin_op_once():
    table = op_table.op_table()
    assert [line.split("`")[1] for line in table.splitlines()[2:]] == list(BUILTIN)
    assert "| `attention` | `(q, k, v, heads, causal=false, mask=none, key_padding_mask=none)` |" in table
    assert "| `gelu` | `(x, approximate=\"none\")` |" in table
    # the random state is flowgrad's own: a call that passes rng= is refused, so the table does not offer it
    assert "| `dropout` | `(x, p=0.5, stream=none)` |" in table and "rng=" not in table


def test_every_builtin_op_names_its_pytorch_counterpart_and_has_a_twin():
    from flowgrad.torch_twin import COUNTERPART, LOWER, counterpart, rule_for  # imports no torch

    assert [n for n in BUILTIN if counterpart(n) is None] == []
    named = [n for n in BUILTIN if get_op(n).torch]
    assert "abs" in named and "relu" in named
    # named once: in the record or in the twin's tables, never both
    assert [n for n in named if n in COUNTERPART or n in LOWER] == []
    # a named function gets the tensor inputs alone: an op with attrs needs a rule of its own
    assert [n for n in named if any(a.kind == "attr" for a in get_op(n).args)] == []
    assert {get_op(n).torch.partition(".")[0] for n in named} <= {"torch", "F"}
    # an op built from others (clamp) never reaches a graph, so it needs no twin of its own
    assert [n for n in BUILTIN if get_op(n).decompose is None and rule_for(n) is None] == []
    table = op_table.op_table()
    assert "| `conv2d` |" in table and "| `F.conv2d` |" in table and "| `torch.abs` |" in table


def test_nondiff_inputs():
    assert {n: set(op.nondiff) for n, op in OPS.items() if op.nondiff} == {
        "embedding": {0}, "cross_entropy": {1, 2}, "attention": {3}, "dropout": {1},
        "batchnorm": {3, 4, 5}, "nll_loss": {1, 2}, "argmax": {0}, "where": {0},
        **{n: {0, 1} for n in ("eq", "ne", "lt", "le", "gt", "ge")}, "topk_indices": {0}, "randn_like": {0, 1},
        "stop_gradient": {0}, "embedding_grad": {0}, "topk_grad": {0}, "topk_pick": {0},
        "maxpool2d_grad": {0}, "maxpool2d_pick": {0}, "batchnorm_grad": {2, 3, 5},
        "cross_entropy_grad": {1, 3}, "nll_loss_grad": {0, 1, 3}, "attention_grad": {3, 5},
        "gather": {1}, "scatter_add": {1}, "one_hot": {0}}


def T(*shape, dtype="f32"):
    return TensorType(tuple(shape), dtype)


def error(name, ins, attrs=None) -> str:
    with pytest.raises(OpTypeError) as e:
        get_op(name).infer(ins, attrs or {})
    msg = str(e.value)
    assert msg.startswith(f"{name}: "), msg
    return msg


# (op, input types, attrs, fragments the message must show)
ERRORS = [
    ("matmul", [T(2, 3), T(4, 5)], {}, ["f32[2,3]", "f32[4,5]", "inner"]),
    ("matmul", [T(2, 2, 3), T(3, 3, 4)], {}, ["batch", "[2]", "[3]", "f32[2,2,3]", "f32[3,3,4]"]),
    ("matmul", [T(3), T(4)], {}, ["f32[3]", "f32[4]"]),
    ("add", [T(2, 3), T(4)], {}, ["[2, 3]", "[4]", "broadcast"]),
    ("mul", [T(2, 3), T(2, 3, dtype="f16")], {}, ["f32[2,3]", "f16[2,3]", "cast"]),
    ("exp", [T(3, dtype="i32")], {}, ["float", "i32[3]"]),
    ("div", [T(3, dtype="i32"), T(3, dtype="i32")], {}, ["float", "i32"]),
    ("matmul", [T(2, 2, dtype="i32"), T(2, 2, dtype="i32")], {}, ["float", "i32"]),
    ("sum", [T(2, 3)], {"axis": 2}, ["axis 2", "rank 2"]),
    ("sum", [T(2, 3)], {"axis": [0, -2]}, ["same axis twice"]),
    ("mean", [T(2, 3)], {"axis": True}, ["axis=True", "int"]),
    ("softmax", [T(2, 3)], {"axis": -3}, ["axis -3"]),
    ("gelu", [T(2)], {"approximate": "erf"}, ["'erf'", "tanh"]),
    ("pow", [T(2)], {}, ["missing", "exponent"]),
    ("pow", [T(2)], {"exponent": "2"}, ["exponent='2'", "float"]),
    ("sum", [T(2)], {"axes": 0}, ["unknown attribute 'axes'"]),
    ("relu", [T(2), T(2)], {}, ["takes 1 tensor input, got 2"]),
    ("attention", [T(2, 4)] * 2, {"heads": 1}, ["3 to 5", "got 2"]),
    ("reshape", [T(2, 3)], {"shape": [4, 2]}, ["[2, 3]", "[4, 2]", "6", "8"]),
    ("reshape", [T(2, 3)], {"shape": [4, -1]}, ["[4, -1]", "multiple"]),
    ("reshape", [T(2, 3)], {"shape": [-1, -1]}, ["one -1"]),
    ("transpose", [T(3)], {}, ["axis -2", "rank 1"]),
    ("permute", [T(2, 3)], {"dims": [0, 0]}, ["permutation"]),
    ("permute", [T(2, 3)], {"dims": [0]}, ["all 2 axes"]),
    ("slice", [T(4, 3)], {"axis": 0, "start": 2, "stop": 5}, ["start=2", "stop=5", "size 4"]),
    ("concat", [T(2, 3), T(3, 4)], {"axis": 0}, ["f32[2,3]", "f32[3,4]"]),
    ("concat", [T(2, 3), T(2, 3, dtype="f16")], {}, ["f32[2,3]", "f16[2,3]"]),
    ("cast", [T(2)], {"dtype": "f64"}, ["dtype='f64'", "f32, f16, i32"]),
    ("layernorm", [T(4, 5), T(4), T(5)], {}, ["weight", "[5]", "f32[4]"]),
    ("rmsnorm", [T(4, 5), T(5)], {"eps": 0}, ["eps=0", "positive"]),
    ("embedding", [T(3), T(5, 2)], {}, ["ids must be i32", "f32[3]"]),
    ("embedding", [T(3, dtype="i32"), T(5)], {}, ["table", "f32[5]"]),
    ("attention", [T(4, 6)] * 3, {"heads": 4}, ["heads=4", "d=6"]),
    ("attention", [T(4, 6), T(2, 4, 6), T(2, 4, 6)], {"heads": 2}, ["f32[4,6]", "f32[2,4,6]"]),
    ("attention", [T(4, 6), T(5, 6), T(4, 6)], {"heads": 2}, ["k: f32[5,6]", "v: f32[4,6]"]),
    ("attention", [T(4, 6), T(5, 6), T(5, 6), T(5, 4)], {"heads": 2}, ["f32[5,4]", "[4, 5]"]),
    ("attention", [T(4, 6), T(5, 6), T(5, 6), T(4, 5, dtype="f16")], {"heads": 2}, ["f16[4,5]", "mask"]),
    ("attention", [T(4, 6)] * 3, {}, ["missing", "heads"]),
    ("mse_loss", [T(2, 3), T(3, 2)], {}, ["f32[2,3]", "f32[3,2]"]),
    ("cross_entropy", [T(4, 5), T(4)], {}, ["targets must be i32", "f32[4]"]),
    ("cross_entropy", [T(4, 5), T(5, dtype="i32")], {}, ["f32[4,5]", "i32[5]", "i32[4]"]),
]


@pytest.mark.parametrize("name, ins, attrs, shows", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_infer_errors_say_what_is_wrong(name, ins, attrs, shows):
    msg = error(name, ins, attrs)
    for fragment in shows:
        assert fragment in msg, f"{fragment!r} missing from: {msg}"


# (op, input types, attrs, result)
TYPES = [
    ("add", [T(2, 1, 3), T(4, 1)], {}, T(2, 4, 3)),
    ("add", [T(2, dtype="i32"), T(2, dtype="i32")], {}, T(2, dtype="i32")),
    ("matmul", [T(5, 1, 2, 3), T(4, 3, 6)], {}, T(5, 4, 2, 6)),
    ("matmul", [T(3), T(2, 3, 4)], {}, T(2, 4)),
    ("matmul", [T(2, 3, 4), T(4)], {}, T(2, 3)),
    ("matmul", [T(4), T(4)], {}, T()),
    ("sum", [T(2, 3, 4)], {}, T()),
    ("sum", [T(2, 3, 4)], {"axis": [0, 2], "keepdims": True}, T(1, 3, 1)),
    ("max", [T(2, 3, 4)], {"axis": -1}, T(2, 3)),
    ("mean", [T(2, 3, 4, dtype="f16")], {"axis": 1}, T(2, 4, dtype="f16")),
    ("reshape", [T(2, 6)], {"shape": [3, -1]}, T(3, 4)),
    ("transpose", [T(2, 3, 4)], {}, T(2, 4, 3)),
    ("permute", [T(2, 3, 4)], {"dims": [-1, 0, 1]}, T(4, 2, 3)),
    ("slice", [T(2, 9)], {"axis": -1, "start": 3, "stop": 6}, T(2, 3)),
    ("concat", [T(2, 3), T(2, 1), T(2, 2)], {}, T(2, 6)),
    ("cast", [T(2, 3)], {"dtype": "i32"}, T(2, 3, dtype="i32")),
    ("embedding", [T(4, 7, dtype="i32"), T(10, 8, dtype="f16")], {}, T(4, 7, 8, dtype="f16")),
    ("attention", [T(2, 4, 6), T(2, 5, 6), T(2, 5, 6)], {"heads": 3, "causal": True}, T(2, 4, 6)),
    ("layernorm", [T(2, 3, 8), T(8), T(8)], {}, T(2, 3, 8)),
    ("cross_entropy", [T(2, 3, 5), T(2, 3, dtype="i32")], {}, T()),
    ("cross_entropy", [T(2, 5, 3), T(2, 3, dtype="i32"), T(5)], {"axis": 1, "label_smoothing": 0.1}, T()),
    ("mse_loss", [T(2, 3), T(2, 3)], {}, T()),
    ("conv2d", [T(2, 4, 7, 6), T(6, 2, 3, 2), T(6)], {"stride": 2, "padding": 1, "groups": 2}, T(2, 6, 4, 4)),
    ("conv2d", [T(1, 3, 5, 5, dtype="f16"), T(2, 3, 3, 3, dtype="f16")], {"padding": "same"},
     T(1, 2, 5, 5, dtype="f16")),
    ("conv1d", [T(2, 3, 9), T(4, 3, 3)], {"stride": 2}, T(2, 4, 4)),
    ("conv_transpose2d", [T(1, 4, 3, 3), T(4, 2, 3, 3)], {"stride": 2, "padding": 1, "output_padding": 1},
     T(1, 2, 6, 6)),
    ("maxpool2d", [T(2, 3, 7, 6)], {"kernel_size": 2}, T(2, 3, 3, 3)),
    ("avgpool2d", [T(2, 3, 7, 6)], {"kernel_size": 3, "stride": 2, "padding": 1}, T(2, 3, 4, 3)),
    ("adaptive_avgpool2d", [T(2, 3, 7, 6)], {"output_size": 1}, T(2, 3, 1, 1)),
    ("flatten", [T(2, 3, 4)], {"start_dim": 1}, T(2, 12)),
    ("pad", [T(2, 3, dtype="i32")], {"pad": [1, 2]}, T(2, 6, dtype="i32")),
    ("dropout", [T(2, 3, dtype="f16"), T(5, dtype="i32")], {"p": 0.1}, T(2, 3, dtype="f16")),
    ("batchnorm", [T(2, 3, 4, 4), T(3), T(3), T(3), T(3), T(5, dtype="i32")], {}, T(2, 3, 4, 4)),
    ("groupnorm", [T(2, 4, 5), T(4), T(4)], {"groups": 2}, T(2, 4, 5)),
    ("erf", [T(3)], {}, T(3)), ("softplus", [T(2, 3)], {"beta": 2}, T(2, 3)),
    ("leaky_relu", [T(3, dtype="f16")], {}, T(3, dtype="f16")), ("elu", [T(3)], {"alpha": 0.5}, T(3)),
    ("l1_loss", [T(2, 3), T(2, 3)], {}, T()), ("huber_loss", [T(3), T(3)], {"delta": 2}, T()),
    ("bce_with_logits", [T(4), T(4)], {}, T()),
    ("nll_loss", [T(4, 3), T(4, dtype="i32")], {}, T()),
    ("argmax", [T(4, 3)], {}, T(4, dtype="i32")), ("argmax", [T(4, 3, dtype="i32")], {"axis": 0, "keepdims": True},
                                                  T(1, 3, dtype="i32")),
    ("eq", [T(4, dtype="i32"), T(4, dtype="i32")], {}, T(4, dtype="i32")), ("ne", [T(2, 1), T(3)], {}, T(2, 3)),
    ("lt", [T(3), T()], {}, T(3)), ("le", [T(3), T(3)], {}, T(3)), ("gt", [T(3), T(3)], {}, T(3)),
    ("ge", [T(3, dtype="f16"), T(3, dtype="f16")], {}, T(3, dtype="f16")),
    ("topk", [T(2, 7)], {"k": 3}, T(2, 3)), ("topk_indices", [T(5, 2)], {"k": 2, "axis": 0}, T(2, 2, dtype="i32")),
    ("one_hot", [T(2, 3, dtype="i32")], {"n": 5}, T(2, 3, 5)),
    ("one_hot", [T(4, dtype="i32")], {"n": 2, "dtype": "f16"}, T(4, 2, dtype="f16")),
    ("gather", [T(3, 4, dtype="f16"), T(2, 6, dtype="i32")], {"axis": -1}, T(2, 6, dtype="f16")),
    ("scatter_add", [T(3, 4), T(2, 6, dtype="i32"), T(2, 7)], {"axis": 1}, T(3, 4)),
    ("cumsum", [T(2, 3)], {"axis": -2}, T(2, 3)),
    ("var", [T(2, 3, 4)], {"axis": [0, -1], "keepdims": True}, T(1, 3, 1)),
    ("std", [T(2, 3, dtype="f16")], {}, T(dtype="f16")),
    ("squeeze", [T(1, 3, 1)], {}, T(3)),
    ("squeeze", [T(2, 1, 3)], {"axis": [0, 1]}, T(2, 3)),
    ("unsqueeze", [T(2, 3, dtype="i32")], {"axis": -1}, T(2, 3, 1, dtype="i32")),
    ("stack", [T(2, 3), T(2, 3)], {"axis": -2}, T(2, 2, 3)),
    ("einsum", [T(2, 3), T(3, 4)], {"equation": "ij,jk"}, T(2, 4)),
    ("einsum", [T(5, 2, 3), T(3)], {"equation": "...j,j"}, T(5, 2)),
    ("maxpool1d", [T(2, 3, 9)], {"kernel_size": 3, "stride": 2, "padding": 1}, T(2, 3, 5)),
    ("avgpool1d", [T(2, 3, 9)], {"kernel_size": 4}, T(2, 3, 2)),
    ("interpolate", [T(1, 2, 5, 3)], {"scale_factor": [0.5, 2.5], "mode": "bilinear"}, T(1, 2, 2, 7)),
    ("interpolate", [T(1, 2, 5, 3)], {"size": 4}, T(1, 2, 4, 4)),
]


@pytest.mark.parametrize("name, ins, attrs, want", TYPES, ids=[f"{t[0]}-{i}" for i, t in enumerate(TYPES)])
def test_infer_types(name, ins, attrs, want):
    assert get_op(name).infer(ins, attrs) == want


def test_bad_ids_and_targets_are_flow_errors_at_run_time():
    table = np.zeros((5, 2), np.float32)
    with pytest.raises(FlowError, match=r"embedding: index 5 at \[1\] is out of range for a table of 5 rows "
                                        r"\(valid: 0..4\)"):
        get_op("embedding").forward([np.array([1, 5], np.int32), table], {})
    with pytest.raises(FlowError, match="target -1 is out of range for 3 classes"):
        get_op("cross_entropy").forward([np.zeros((2, 3), np.float32), np.array([0, -1], np.int32)], {})


# ---------------------------------------------------------------- fuzz

ATTR_VALUES = {
    "axis": [None, -1, 0, 1, 2, [0], [0, -1], [], 7, True, "x"],
    "keepdims": [False, True, 1],
    "approximate": ["none", "tanh", "erf"],
    "exponent": [2, -1, 0.5, "2"],
    "eps": [1e-5, 1, 0, -1.0],
    "shape": [[-1], [2, -1], [1, 2, 3], [4], [-1, -1], [2, 0], "4"],
    "dim0": [-2, -1, 0, 1, 3],
    "dim1": [-2, -1, 0, 1, 3],
    "dims": [[0], [1, 0], [2, 0, 1], [0, 0], [0, 1, 2, 3]],
    "start": [-2, -1, 0, 1, 2, 3],
    "stop": [-2, -1, 0, 1, 2, 3],
    "dtype": ["f32", "f16", "i32", "f64"],
    "heads": [1, 2, 3, 0, -1],
    "causal": [False, True],
    "stride": [None, 1, 2, [1, 2], [0, 1], "2"],
    "padding": [0, 1, [1, 0], "same", "valid", "full", -1],
    "dilation": [1, 2, [2, 1], 0],
    "groups": [1, 2, 3, 0],
    "output_padding": [0, 1, [1, 0], 3],
    "kernel_size": [1, 2, 3, [2, 1], 0],
    "count_include_pad": [True, False],
    "output_size": [1, 2, [2, 3], 0],
    "start_dim": [0, 1, -1, 5],
    "end_dim": [0, -1, 1, 5],
    "pad": [[1, 1], [0, 1, 2, 0], [1], [-1, 0], []],
    "value": [0.0, 1.5, -2],
    "p": [0.0, 0.5, 1, 1.5, -0.1],
    "stream": [None, 0, 7],
    "momentum": [0.1, 0.0, 1.5],
    "ignore_index": [-100, 0, 3],
    "label_smoothing": [0.0, 0.1, 1.5],
    "beta": [1.0, 2, 0, -1.0],
    "threshold": [20.0, 1, -3.0],
    "negative_slope": [0.01, 0.5, -1],
    "alpha": [1.0, 0.3],
    "delta": [1.0, 0.5, 0, -1],
    "k": [1, 2, 0, 9],
}
ANY_ATTR_VALUES = [None, 0, 1.5, -2, "x", [1], True]  # for an attr not listed above
DTYPE_PICKS = ["f32", "f32", "f32", "f16", "i32"]


# A valid call of every op (TYPES covers the rest); the fuzz mutates these.
EXTRA_VALID = [
    ("neg", [T(2, 3, dtype="i32")], {}), ("log", [T(3)], {}), ("sqrt", [T(3)], {}),
    ("tanh", [T(3)], {}), ("sigmoid", [T(3)], {}), ("silu", [T(3)], {}),
    ("gelu", [T(2, 3)], {"approximate": "tanh"}), ("pow", [T(3)], {"exponent": 2}),
    ("sub", [T(3), T(2, 1)], {}), ("mul", [T(3), T()], {}), ("div", [T(2, 3), T(3)], {}),
    ("softmax", [T(2, 3)], {}), ("log_softmax", [T(2, 3)], {"axis": 0}),
    ("rmsnorm", [T(2, 3), T(3)], {}),
    ("attention", [T(3, 2), T(2, 2), T(2, 2), T(3, 2)], {"heads": 2}),
    # no record sample: its out must be attention's output at q, k, v (tests/test_ops_numeric.py draws it)
    ("attention_grad", [T(2, 3, 4), T(2, 5, 4), T(2, 5, 4), T(2, 3, 4), T(2, 3, 4), T(3, 5, dtype="i32")],
     {"heads": 2, "causal": True}),
]
VALID = {}
for _name, _ins, _attrs, *_ in op_samples.types() + TYPES + EXTRA_VALID + scan_samples.scan_calls():
    VALID.setdefault(_name, []).append((_ins, _attrs))


def test_every_op_has_a_valid_call_to_fuzz():
    assert set(VALID) == set(OPS)


@st.composite
def op_call(draw, name):
    """A valid call of the op with 0 to 2 mutations: a dim, a rank, a
    dtype, an attr value, a missing attr, a missing or extra tensor."""
    types, attrs = draw(st.sampled_from(VALID[name]))
    types, attrs = list(types), dict(attrs)
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(["dim", "rank", "dtype", "attr", "drop_attr", "tensors"]))
        i = draw(st.integers(0, len(types) - 1)) if types else 0
        if kind == "dim" and types and types[i].shape:
            shape = list(types[i].shape)
            shape[draw(st.integers(0, len(shape) - 1))] = draw(st.integers(1, 4))
            types[i] = TensorType(tuple(shape), types[i].dtype)
        elif kind == "rank" and types:
            shape = types[i].shape
            shape = shape[1:] if shape and draw(st.booleans()) else (draw(st.integers(1, 3)),) + shape
            types[i] = TensorType(shape, types[i].dtype)
        elif kind == "dtype" and types:
            types[i] = TensorType(types[i].shape, draw(st.sampled_from(["f32", "f16", "i32"])))
        elif kind == "attr":
            names = [a.name for a in get_op(name).args if a.kind == "attr"]
            if names:
                key = draw(st.sampled_from(names))
                attrs[key] = draw(st.sampled_from(ATTR_VALUES.get(key, ANY_ATTR_VALUES)))
        elif kind == "drop_attr" and attrs:
            del attrs[draw(st.sampled_from(sorted(attrs)))]
        elif kind == "tensors":
            types = types[:-1] if draw(st.booleans()) else types + [draw(st.sampled_from(types or [T(2)]))]
    return types, attrs


def _array(t: TensorType, rng):
    if t.dtype == "i32":
        return np.zeros(t.shape, np.int32)  # valid ids and targets for any table or class count
    return rng.standard_normal(t.shape).astype(NUMPY_DTYPE[t.dtype])


@pytest.mark.parametrize("name", sorted(OPS))
def test_fuzz_infer_forward_vjp_agree(name):
    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(call=op_call(name))
    def run(call):
        types, attrs = call
        op = get_op(name)
        try:
            want = op.infer(types, attrs)
        except OpTypeError as e:
            assert str(e).startswith(f"{name}: ")
            return
        rng = np.random.default_rng(0)
        ins = [_array(t, rng) for t in types]
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            out = op.forward(ins, attrs)
            assert out.shape == want.shape and out.dtype == NUMPY_DTYPE[want.dtype], (types, attrs, want)
            grads = op.vjp(np.ones(out.shape, out.dtype), ins, out, attrs)
        assert len(grads) == len(ins)
        for i, (d, x) in enumerate(zip(grads, ins)):
            assert d is None or d.shape == x.shape, (types, attrs, i)

    run()
