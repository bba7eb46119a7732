"""The .flow language: parse -> build -> Graph (no device needed): the
example models, the parser, spans, config and dtypes. Calls, blocks,
outputs, the train section and the docs' examples: test_dsl_calls.py.

Errors are in test_errors.py; the `flowgrad check` command in test_cli_check.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad import dsl
from flowgrad.dsl.parser import lark_parser
from flowgrad.graph_check import check_graph

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


def build(src: str, config=None, dtype="f32", file="t.flow"):
    return dsl.build(dsl.parse(src, file), config, dtype)


# ---------------------------------------------------------------- the example models

@pytest.mark.parametrize("path", sorted(MODELS.glob("*.flow")), ids=lambda p: p.name)
def test_every_model_file_builds_and_checks(path):
    graph = fg.load(path).graph
    check_graph(graph)
    assert graph.loss is not None and graph.nodes[graph.loss].shape == ()
    assert graph.params and graph.inputs and graph.outputs


def test_mlp_graph():
    g = fg.load(MODELS / "mlp.flow").graph
    assert g.name == "mlp"
    assert g.config == {"inputs": 64, "hidden": 128, "classes": 10, "batch": 64}
    assert list(g.inputs) == ["x", "y"]
    assert str(g.nodes[g.inputs["x"]].type) == "f32[64,64]"
    assert str(g.nodes[g.inputs["y"]].type) == "i32[64]"
    assert list(g.params) == ["w1", "b1", "w2", "b2"]
    assert g.nodes[g.params["w1"]].attrs["init"] == ("xavier", {})
    h = g.node("h")
    assert (h.op, str(h.type)) == ("relu", "f32[64,128]")
    assert g.node("logits").op == "add"
    assert g.node("loss").op == "cross_entropy"
    assert set(g.outputs) == {"logits", "loss"} and g.outputs["loss"] == g.loss


def test_tiny_gpt_graph():
    g = fg.load(MODELS / "tiny_gpt.flow").graph
    layers = g.config["layers"]
    assert layers >= 2
    for k in range(layers):
        assert f"decoder.{k}.wqkv" in g.params
        attn = g.node(f"decoder.{k}.a")
        assert attn.op == "attention" and attn.attrs["heads"] == g.config["heads"] and attn.attrs["causal"]
        # causal=true is an index rule: no mask tensor is built for it
        assert [g.nodes[i].op for i in attn.inputs] == ["slice"] * 3
    assert f"decoder.{layers}.wqkv" not in g.params
    assert g.nodes[g.inputs["tokens"]].dtype == "i32"
    assert g.nodes[g.outputs["logits"]].shape == (g.config["batch"], g.config["seq"], g.config["vocab"])
    assert g.train.items["data"] == ("call", "reverse", [], {"seq": g.config["seq"], "vocab": g.config["vocab"]})
    assert g.train.items["optimizer"][:2] == ("call", "adamw")


@pytest.mark.parametrize("name", ["mlp.flow", "tiny_gpt.flow"])
def test_model_files_step_with_finite_nonzero_grads(name):
    model = fg.load(MODELS / name, {"batch": 4})
    g = model.graph
    sess = model.compile(device="cpu", seed=1)
    rng = np.random.default_rng(0)
    feeds = {}
    for inp, i in g.inputs.items():
        n = g.nodes[i]
        if n.dtype == "i32":
            high = g.config.get("vocab", g.config.get("classes"))
            feeds[inp] = rng.integers(0, high, n.shape)
        else:
            feeds[inp] = rng.normal(size=n.shape)
    res = sess.step(feeds)
    assert np.isfinite(res.loss) and res.loss > 0
    assert set(res.grads) == set(g.params)
    for pname, grad in res.grads.items():
        assert grad.shape == g.nodes[g.params[pname]].shape
        assert np.all(np.isfinite(grad)), pname
        assert np.any(grad != 0), f"gradient of {pname} is all zeros"


# ---------------------------------------------------------------- parser

def test_parser_is_built_once_without_lark_cache():
    assert lark_parser() is lark_parser()
    assert lark_parser().options.cache is False
    assert lark_parser().options.parser == "lalr"


def test_grammar_is_package_data():
    path = Path(dsl.grammar_path())
    assert path.name == "flow.lark" and path.parent.name == "grammars" and path.parent.parent.name == "flowgrad"
    assert (ROOT / "grammars" / "flow.lark").resolve() == path.resolve()


def test_parse_is_syntax_only():
    # unknown ops and names are the builder's business, not the parser's
    prog = dsl.parse("y = nosuchop(undefined_name)\n", "p.flow")
    assert prog.file == "p.flow" and len(prog.stmts) == 1
    with pytest.raises(fg.FlowError):
        dsl.build(prog)


def test_layout_comments_blank_lines_and_continuations():
    g = build("""# leading comment

model  layout   # trailing comment
config { n = 3 }
config {

  # a comment inside a block
  m = 2   # and after a value
}
input x: f32[n,
             m,]          # newlines inside [ ] are joined
y = add(x,
        x,                # and inside ( ), with a trailing comma
        )
output y""")
    assert g.name == "layout" and g.config == {"n": 3, "m": 2}
    assert g.node("y").op == "add" and g.node("y").shape == (3, 2)


def test_model_name_from_file():
    g = build("# no model line\ninput x: f32[2]\n", file="dir/my_model.flow")
    assert g.name == "my_model" and [n.name for n in g.nodes] == ["x"]


# ---------------------------------------------------------------- spans

def test_spans_have_file_line_col_text_and_end():
    src = "input x: f32[2]\n\ny = x  +  x * 2.0\n"
    g = build(src, file="s.flow")
    y = g.node("y")
    assert (y.span.file, y.span.line, y.span.col) == ("s.flow", 3, 5)
    assert y.span.text == "y = x  +  x * 2.0"
    assert y.span.end_col == len("y = x  +  x * 2.0") + 1
    mul = g.nodes[y.inputs[1]]
    assert (mul.op, mul.span.col, mul.span.end_col) == ("mul", 11, 18)
    assert y.span.via == ()


def test_block_nodes_carry_the_call_sites_that_expanded_them():
    src = """\
block inner(x) {
  y = x * 2.0
  return y
}
block outer(x) {
  return inner(x)
}
input a: f32[3]
b = outer(a)
c = repeat(2, inner, b)
"""
    g = build(src, file="v.flow")
    deep = g.node("outer.0.inner.0.y")
    assert deep.span.line == 2
    assert [(s.line, s.col) for s in deep.span.via] == [(6, 10), (9, 5)]   # innermost first
    assert deep.span.via[0].text == "  return inner(x)"
    rep = g.node("inner.1.y")
    assert [(s.line, s.col) for s in rep.span.via] == [(10, 5)]
    assert g.node("inner.0.y").span.via[0].line == 10


# ---------------------------------------------------------------- config

CFG = """
config {
  n = 4
  half = n / 2
  rate = 0.5
  flag = true
  label = "hello"
  kind = f16
  neg = -3
}
input x: f32[n, half]
"""


def test_config_values_of_every_type():
    g = build(CFG)
    assert g.config == {"n": 4, "half": 2, "rate": 0.5, "flag": True, "label": "hello", "kind": "f16", "neg": -3}
    assert type(g.config["half"]) is int and type(g.config["flag"]) is bool
    assert g.nodes[0].shape == (4, 2)


def test_config_overrides_are_typed_against_the_declaration():
    # strings (as from `--set`) are parsed by the declared type
    g = build(CFG, {"n": "8", "rate": "1e-3", "flag": "false", "label": "bye", "kind": "i32"})
    assert g.config["n"] == 8 and g.config["half"] == 4        # later keys follow the override
    assert g.config["rate"] == 1e-3 and g.config["flag"] is False
    assert g.config["label"] == "bye" and g.config["kind"] == "i32"
    assert g.nodes[0].shape == (8, 4)
    # Python values from the API: an int is fine for a float key
    g = build(CFG, {"n": 6, "rate": 2, "flag": True, "half": 5})
    assert g.config["rate"] == 2.0 and type(g.config["rate"]) is float
    assert g.config["half"] == 5 and g.nodes[0].shape == (6, 5)


@pytest.mark.parametrize("key, text", [("n", "1_000"), ("n", "\u0663"), ("n", "\uff18"), ("rate", "1_0.5"),
                                       ("rate", "infinity"), ("rate", "\u0661.5")])
def test_set_numbers_are_spelled_as_literals(key, text):
    # int() and float() take these; a .flow file cannot write them
    with pytest.raises(fg.FlowError, match=f"got '{text}'"):
        build(CFG, {key: text})


def test_set_numbers_may_have_a_sign_and_spaces():
    g = build(CFG, {"n": " +8 ", "rate": "-.5e1"})
    assert g.config["n"] == 8 and g.config["rate"] == -5.0


def test_an_overridden_key_need_not_evaluate_under_the_other_overrides():
    # half = n / 2 fails for n=7, but half is given too: its expression is replaced
    g = build(CFG, {"n": "7", "half": "3"})
    assert g.config["n"] == 7 and g.config["half"] == 3 and g.nodes[0].shape == (7, 3)
    with pytest.raises(fg.FlowError, match="declared as 2 here"):   # still typed as declared
        build(CFG, {"n": "7", "half": "3.5"})
    with pytest.raises(fg.FlowError, match="7 / 2 is not an exact integer division"):
        build(CFG, {"n": "7"})


def test_config_dtype_in_a_declaration():
    g = build("config { t = f16 }\ninput x: t[2]\n")
    assert g.nodes[0].dtype == "f16"
    g = build("config { t = f16 }\ninput x: t[2]\n", {"t": "f32"}, dtype="f16")
    assert g.nodes[0].dtype == "f16"   # an f32 declaration follows the compile dtype


def test_shape_arithmetic():
    g = build("config {\n d = 12\n heads = 3\n}\ninput x: f32[3*d, d/heads, (d - 2) * 2, 2**3]\n")
    assert g.nodes[0].shape == (36, 4, 20, 8)


# ---------------------------------------------------------------- dtypes and literals

POLICY = """
input x: f32[2, 3]
input i: i32[2]
input h: f16[3]
param w: f32[3] = ones()
y = x * w + 1.5
z = cast(x, f32)
k = i + 1
"""


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_dtype_policy(dtype):
    g = build(POLICY, dtype=dtype)
    assert g.node("x").dtype == dtype and g.nodes[g.params["w"]].dtype == dtype
    assert g.node("i").dtype == "i32" and g.node("h").dtype == "f16"
    y = g.node("y")
    const = g.nodes[y.inputs[1]]
    assert const.op == "const" and const.shape == () and const.dtype == dtype
    assert const.attrs["value"] == np.float32(1.5) and const.attrs["value"].dtype == np.dtype(dtype.replace("f", "float"))
    assert g.node("z").dtype == "f32"          # an explicit cast keeps its dtype
    k_const = g.nodes[g.node("k").inputs[1]]
    assert k_const.dtype == "i32" and k_const.attrs["value"] == 1


def test_literal_on_either_side_and_constant_folding():
    g = build("input x: f32[2]\na = 2.0 - x\nb = x / (1.0 / 4 + 0.25)\n")
    a = g.node("a")
    assert a.op == "sub" and g.nodes[a.inputs[0]].op == "const" and g.nodes[a.inputs[1]].name == "x"
    b = g.node("b")
    assert float(g.nodes[b.inputs[1]].attrs["value"]) == 0.5


def test_a_literal_takes_the_data_dtype_not_the_condition_dtype():
    g = build("input c: i32[2]\ninput x: f32[2]\na = where(c, x, 0.0)\nb = where(c, 0, x)\n")
    for name in ("a", "b"):
        node = g.node(name)
        assert node.dtype == "f32" and {g.nodes[i].dtype for i in node.inputs[1:]} == {"f32"}


def test_literals_alone_beside_an_i32_condition_keep_their_own_dtype():
    g = build("input c: i32[2]\na = where(c, 1.0, 0.0)\nb = where(c, 1, 0)\n")
    assert g.node("a").dtype == "f32" and g.node("b").dtype == "i32"
    with pytest.raises(fg.FlowError, match="the float 1.5, but the tensor it meets is i32"):
        build("input c: i32[2]\na = eq(c, 1.5)\n")   # c is data here, not a condition


def test_unary_minus_and_power():
    g = build("input x: f32[2]\na = -x\nb = -x ** 2\nc = x ** -1\n")
    assert g.node("a").op == "neg"
    b = g.node("b")
    assert b.op == "neg" and g.nodes[b.inputs[0]].op == "pow"        # -x**2 == -(x**2)
    assert g.node("c").attrs["exponent"] == -1
