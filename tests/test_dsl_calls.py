"""The .flow language, built (no device needed): op calls (positional,
keyword, defaults), split, named values, blocks and repeat, initialisers,
outputs and minimize, the train section as written, and every example in
docs/language.md."""
from __future__ import annotations

import re
from pathlib import Path

import flowgrad as fg
from flowgrad import dsl
from flowgrad.graph import TrainSpec
from flowgrad.graph_check import check_graph
from flowgrad.training.section import setup

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


def build(src: str, config=None, dtype="f32", file="t.flow"):
    return dsl.build(dsl.parse(src, file), config, dtype)


# ---------------------------------------------------------------- calls

def test_calls_positional_keyword_and_defaults():
    g = build("""
input x: f32[2, 3, 4]
a = sum(x, 1)
b = sum(x, axis=[0, 2], keepdims=true)
c = softmax(x)
d = gelu(x, approximate="tanh")
e = reshape(x, [2, 3*4])
f = transpose(x)
g = concat(x, x, axis=0)
h = concat([x, x])
""")
    assert g.node("a").attrs == {"axis": 1, "keepdims": False}
    assert g.node("b").attrs == {"axis": (0, 2), "keepdims": True} and g.node("b").shape == (1, 3, 1)
    assert g.node("c").attrs == {"axis": -1}
    assert g.node("d").attrs == {"approximate": "tanh"}
    assert g.node("e").shape == (2, 12) and list(g.node("e").attrs["shape"]) == [2, 12]
    assert g.node("f").shape == (2, 4, 3)
    assert g.node("g").shape == (4, 3, 4) and len(g.node("g").inputs) == 2
    assert g.node("h").shape == (2, 3, 8)


def test_optional_tensor_keyword():
    src = """
input q: f32[4, 8]
input m: f32[4, 4]
a = attention(q, q, q, heads=2)
b = attention(q, q, q, heads=2, mask=m)
c = attention(q, q, q, 2, true, m)
"""
    g = build(src)
    assert len(g.node("a").inputs) == 3
    assert g.nodes[g.node("b").inputs[3]].name == "m"
    c = g.node("c")
    # causal plus a user mask: the mask input is the user's; causality stays an attr
    assert g.nodes[c.inputs[3]].name == "m" and c.attrs["heads"] == 2 and c.attrs["causal"]


def test_split_emits_slices():
    g = build("input x: f32[2, 9]\na, b, c = split(x, 3)\nd, e = split(x, [1, 1], axis=0)\n")
    assert [(g.node(n).op, g.node(n).attrs["start"], g.node(n).attrs["stop"]) for n in "abc"] == [
        ("slice", 0, 3), ("slice", 3, 6), ("slice", 6, 9)]
    assert g.node("a").attrs["axis"] == -1 and g.node("a").shape == (2, 3)
    assert g.node("d").shape == (1, 9) and g.node("e").attrs["start"] == 1


# ---------------------------------------------------------------- names, blocks, repeat

def test_named_values_and_rebinding():
    g = build("input x: f32[2]\nh = x * 2.0\nh = h + x\nalias = h\noutput alias\n")
    names = [n.name for n in g.nodes if n.op == "mul" or n.op == "add"]
    assert names == ["h", "h"]                    # both bindings keep the source name
    assert g.outputs["alias"] == g.nodes[-1].id   # an alias does not rename a named node


BLOCKS = """
config { d = 4 }
block lin(x, scale) {
  param w: f32[d, d] = normal(std=0.1)
  y = x @ w * scale
  return y
}
block two(a, b) {
  return b, a + b
}
input x: f32[2, d]
p = lin(x, 0.5)
q = lin(p, 2)
r = repeat(3, lin, q, 1.0)
s, t = repeat(2, two, x, x)
u = repeat(0, lin, x, 1.0)
output p, r, s, t, u
"""


def test_blocks_and_repeat():
    g = build(BLOCKS)
    out = {name: g.nodes[i] for name, i in g.outputs.items()}
    assert list(g.params) == [f"lin.{k}.w" for k in range(5)]   # direct calls 0, 1; repeat continues 2..4
    assert out["p"].name == "lin.0.y"              # p aliases the block's named result
    assert out["r"].name == "lin.4.y"              # the last of the three repeated instances
    # each instance reads the previous instance's output
    assert g.nodes[g.nodes[g.node("lin.3.y").inputs[0]].inputs[0]].name == "lin.2.y"
    assert out["u"].name == "x"                    # repeat 0 times is the identity
    assert (out["s"].op, out["s"].name, out["t"].name) == ("add", "s", "t")
    assert g.nodes[out["t"].inputs[1]].id == out["s"].id


def test_nested_blocks_prefix_params():
    g = build("""
block leaf(x) {
  param w: f32[2] = ones()
  return x * w
}
block pair(x) {
  return leaf(leaf(x))
}
input x: f32[2]
y = repeat(2, pair, x)
""")
    assert list(g.params) == ["pair.0.leaf.0.w", "pair.0.leaf.1.w", "pair.1.leaf.0.w", "pair.1.leaf.1.w"]


def test_initialisers():
    g = build("""
param a: f32[2, 3] = zeros()
param b: f32[2, 3] = ones()
param c: f32[2, 3] = normal(mean=1, std=0.5)
param d: f32[2, 3] = uniform(low=-1, high=1.0)
param e: f32[2, 3] = xavier()
param f: f32[2, 3] = kaiming()
param g: f32[3] = normal(0.0, 2)
""")
    inits = {n: g.nodes[i].attrs["init"] for n, i in g.params.items()}
    assert inits["c"] == ("normal", {"mean": 1.0, "std": 0.5})
    assert inits["d"] == ("uniform", {"low": -1.0, "high": 1.0})
    assert inits["g"] == ("normal", {"mean": 0.0, "std": 2.0})
    assert [inits[k][0] for k in "abef"] == ["zeros", "ones", "xavier", "kaiming"]


def test_xavier_and_kaiming_count_a_convolution_kernel_in_the_fans():
    # fans as torch.nn.init computes them: a conv weight [out, in, kh, kw] has fan_in in*kh*kw,
    # not kh (its second-to-last dim), which made kaiming() 4x too wide for 6 channels in
    import numpy as np

    from flowgrad.initializers import init_params

    g = build("""
input x: f32[2, 6, 8, 8]
param k: f32[12, 6, 3, 3] = kaiming()
param kx: f32[12, 6, 3, 3] = xavier()
param t: f32[12, 5, 2, 2] = kaiming()
param c: f32[4, 5, 3] = xavier()
param w: f32[79, 16] = kaiming()
h = conv_transpose2d(conv2d(x, k, padding=1) + conv2d(x, kx, padding=1), t)
z = conv1d(reshape(h, [2, 5, 81]), c) @ w
output z
""")
    p = init_params(g, 0)
    bounds = {"k": np.sqrt(2) * np.sqrt(3 / 54), "kx": np.sqrt(6 / (54 + 108)), "t": np.sqrt(2) * np.sqrt(3 / 20),
              "c": np.sqrt(6 / (15 + 12)), "w": np.sqrt(2) * np.sqrt(3 / 79)}
    for name, bound in bounds.items():
        assert bound * 0.9 < np.abs(p[name]).max() <= bound, name


# ---------------------------------------------------------------- outputs, minimize, train

def test_minimized_value_is_an_output_once():
    g = build("input x: f32[2]\nloss = mean(x * x)\nminimize loss\noutput loss, x\n")
    assert g.outputs == {"loss": g.loss, "x": g.inputs["x"]}


def test_train_section_items_as_written():
    g = build("""
config { lr = 0.01 }
input x: f32[2]
train {
  data = digits(test_fraction=0.2)
  optimizer = adam(lr=lr, betas=[0.9, 0.99])
  steps = 400
  name = "run"
  flag = false
  schedule = cosine(warmup(10), 0.1)
}
""")
    assert isinstance(g.train, TrainSpec)
    assert g.train.items == {
        "data": ("call", "digits", [], {"test_fraction": 0.2}),
        "optimizer": ("call", "adam", [], {"lr": 0.01, "betas": [0.9, 0.99]}),
        "steps": 400, "name": "run", "flag": False,
        "schedule": ("call", "cosine", [("call", "warmup", [10], {}), 0.1], {}),
    }
    assert g.train.spans["steps"].line == 7 and g.train.spans["steps"].text == "  steps = 400"
    assert build("input x: f32[2]\n").train is None


def test_train_values_follow_config_overrides():
    g = fg.load(MODELS / "tiny_gpt.flow", {"seq": 8}).graph
    assert g.train.items["data"][3]["seq"] == 8


# ---------------------------------------------------------------- docs

def flow_blocks(path: Path):
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in
            re.finditer(r"```flow\n(.*?)```", text, re.S)]


def test_language_doc_examples_parse_and_whole_models_build():
    doc = ROOT / "docs" / "language.md"
    blocks = flow_blocks(doc)
    assert len(blocks) >= 6
    built = 0
    for line, code in blocks:
        prog = dsl.parse(code, f"language.md:{line}")
        if code.startswith("model "):   # a whole model: it must build, too
            graph = dsl.build(prog)
            check_graph(graph)
            if "\ntrain {" in code:       # and its train section check, as `flowgrad check` runs it
                setup(graph)
            built += 1
    assert built >= 6


def test_the_readme_model_is_models_mlp():
    """The README's "A model" is models/mlp.flow (comments aside)."""
    from flowgrad.dsl.printer import to_source

    readme = (ROOT / "README.md").read_text()
    code = re.search(r"## A model\n\n```\n(.*?)```", readme, re.S).group(1)
    shipped = (ROOT / "models" / "mlp.flow").read_text()
    assert to_source(dsl.parse(code, "README.md")) == to_source(dsl.parse(shipped, "mlp.flow"))
