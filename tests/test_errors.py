"""Bad inputs: each is a FlowError at the right `file:line:col` with a message
a user can act on, and never a traceback from inside the parser."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError

FILE = "bad.flow"

# (id, source, config overrides, "line:col" or None for no span, message fragments)
CASES = [
    ("syntax-expected-list", "input x: f32[2]\noutput x y\n", None, "2:10",
     ["syntax error: unexpected name 'y', expected one of: ',' a new line"]),
    ("syntax-expected-one", "input x f32[2]\n", None, "1:9",
     ["syntax error: unexpected name 'f32', expected ':'"]),
    ("syntax-in-call", "y = f(1 2)\n", None, "1:9",
     ["syntax error: unexpected number 2, expected one of: an operator ')' ','"]),
    ("syntax-missing-operand", "input x: f32[2]\ny = x +* 2\n", None, "2:8",
     ["syntax error: unexpected '*', expected an expression"]),
    ("syntax-end-of-file", "input x: f32[2]\ny = relu(x", None, "2:11",
     ["syntax error: unexpected end of file, expected one of:", "')' ','"]),
    ("syntax-unclosed-paren", "input x: f32[2]\ny = relu(x\noutput y\n", None, "3:1",
     ["syntax error: unexpected keyword 'output'", "hint: the '(' at line 2, column 9 is never closed"]),
    ("return-outside-block", "input x: f32[2]\nreturn x\n", None, "2:8",
     ["expected one of: ',' '='", "hint: 'return' ends a block's body; a model names its results with 'output NAME'"]),
    ("empty-file", "# nothing yet\n\n", None, "1:1", ["the model file declares nothing"]),
    ("leading-zeros", "input x: f32[2]\ny = x * 007\n", None, "2:9", ["leading zeros in the integer 007: write 7"]),
    ("unexpected-character", "input x: f32[2]\ny = x $ 2\n", None, "2:7",
     ["syntax error: unexpected character '$'"]),
    ("positional-after-keyword", "input x: f32[2]\ny = sum(x=x, 0)\n", None, "2:14",
     ["positional argument after a keyword argument"]),
    ("keyword-twice", "input x: f32[2]\ny = sum(x, axis=0, axis=0)\n", None, "2:20",
     ["keyword argument 'axis' is given twice"]),
    ("unknown-op", "input x: f32[2]\ny = relo(x)\n", None, "2:5",
     ["unknown op or block 'relo' (did you mean relu?)"]),
    ("unknown-name", "input x: f32[2]\ninput mask: f32[2]\ny = relu(x) * mask2\n", None, "3:15",
     ["unknown name 'mask2' (did you mean mask?)"]),
    ("unknown-keyword", "input x: f32[2, 3]\ny = sum(x, axes=0)\n", None, "2:12",
     ["sum() has no argument 'axes' (did you mean axis?)", "hint: signature: sum(x, axis=none, keepdims=false)"]),
    ("missing-argument", "input x: f32[2, 3]\nparam g: f32[3] = ones()\ny = layernorm(x, g)\n", None, "3:5",
     ["layernorm() is missing its argument 'bias'"]),
    ("too-many-positional", "input x: f32[2]\ny = relu(x, x)\n", None, "2:13",
     ["relu() takes 1 positional argument but 2 were given"]),
    ("bad-attribute-type", "input x: f32[2, 3]\ny = softmax(x, axis=0.5)\n", None, "2:16",
     ["softmax(): argument 'axis' must be an int, got float 0.5"]),
    ("none-attribute", "input x: f32[2, 3]\ny = gelu(x, approximate=none)\n", None, "2:13",
     ["gelu(): argument 'approximate' must be a string, got none\n"]),
    ("tensor-as-attribute", "input x: f32[2, 3]\ny = softmax(x, axis=x)\n", None, "2:16",
     ["softmax(): argument 'axis' must be a constant, not a tensor"]),
    ("matmul-shapes", "input x: f32[2, 3]\nparam w: f32[4, 5] = xavier()\ny = x @ w\n", None, "3:5",
     ["matmul:", "f32[2,3]", "f32[4,5]"]),
    ("broadcast-shapes", "input x: f32[2, 3]\ninput b: f32[4]\ny = x + b\n", None, "3:5",
     ["add: shapes [2, 3] and [4] do not broadcast"]),
    ("dtype-mismatch", "input x: f32[2, 3]\ninput i: i32[2, 3]\ny = x * i\n", None, "3:5",
     ["mul: dtype mismatch", "f32[2,3]", "i32[2,3]"]),
    ("float-literal-with-i32", "input i: i32[2]\ny = i * 0.5\n", None, "2:9",
     ["an operand of '*' is the float 0.5, but the tensor it meets is i32"]),
    ("redefined-input-by-assignment", "input x: f32[2]\nx = x * 2.0\n", None, "2:1",
     ["redefined name 'x': 'x' is already an input (line 1, column 7)"]),
    ("redefined-input", "input x: f32[2]\ninput x: f32[3]\n", None, "2:7",
     ["redefined input 'x': 'x' is already an input"]),
    ("redefined-param", "param w: f32[2] = zeros()\nparam w: f32[3] = ones()\n", None, "2:7",
     ["redefined param 'w': 'w' is already a param (line 1, column 7)"]),
    ("assign-to-config-key", "config { d = 2 }\nd = 3\n", None, "2:1",
     ["redefined name 'd': it is a config key (line 1)"]),
    ("minimize-non-scalar", "input x: f32[4, 2]\nminimize x\n", None, "2:10",
     ["minimize needs a scalar, but x is f32[4,2]", "hint: reduce it first"]),
    ("minimize-unknown", "input x: f32[2]\nloss = mean(x)\nminimize los\n", None, "3:10",
     ["unknown name 'los' (did you mean loss?)"]),
    ("output-unknown", "input x: f32[2]\nlogits = x * 2.0\noutput logit\n", None, "3:8",
     ["unknown name 'logit' (did you mean logits?)"]),
    ("minimize-twice", "input x: f32[2]\nl = mean(x)\nminimize l\nminimize l\n", None, "4:10",
     ["l is already minimized, at line 3"]),
    ("over-unknown", "param w: f32[2] = zeros()\nl = sum(w)\nminimize l over v\n", None, "3:17",
     ["minimize l over: 'v' matches no param", "its params: w"]),
    ("unknown-initialiser", "param w: f32[2, 2] = xavir()\n", None, "1:22",
     ["unknown initialiser 'xavir' (did you mean xavier?)"]),
    ("initialiser-bad-keyword", "param w: f32[2] = normal(sd=0.1)\n", None, "1:26",
     ["normal() has no argument 'sd' (did you mean std?)"]),
    # what numpy's samplers refuse (they test the sign bit: -0.0 is negative), at the argument
    ("initialiser-negative-std", "param w: f32[2] = normal(std=-0.5)\n", None, "1:30",
     ["normal(): std must be >= 0, got -0.5"]),
    ("initialiser-negative-zero-std", "param w: f32[2] = normal(0.0, -0.0)\n", None, "1:31",
     ["normal(): std must be >= 0, got -0.0 (numpy's sampler takes -0.0 for negative: write 0.0)"]),
    ("initialiser-negative-zero-gain", "param w: f32[2, 2] = kaiming(gain=-0.0)\n", None, "1:35",
     ["kaiming(): gain must be >= 0, got -0.0"]),
    ("initialiser-negative-gain", "param w: f32[2, 2] = xavier(-2)\n", None, "1:29",
     ["xavier(): gain must be >= 0, got -2.0"]),
    ("initialiser-low-above-high", "param w: f32[2] = uniform(low=1.0, high=0.5)\n", None, "1:19",
     ["uniform(): low must be <= high, got low=1.0, high=0.5"]),
    ("initialiser-negative-zero-range", "param w: f32[2] = uniform(0.0, -0.0)\n", None, "1:19",
     ["uniform(): low must be <= high, got low=0.0, high=-0.0 (numpy's sampler takes high - low = -0.0 for "
      "negative)"]),
    # past what the argument checks know: numpy's own verdict, with the fans the param gets
    ("initialiser-range-overflows", "param w: f32[2] = uniform(low=-1e308, high=1e308)\n", None, "1:1",
     ["param w: numpy refuses uniform(low=-1e+308, high=1e+308): high - low range exceeds valid bounds"]),
    ("initialiser-gain-overflows", "param w: f32[2, 2] = xavier(gain=1e308)\n", None, "1:1",
     ["param w: numpy refuses xavier(gain=1e+308): high - low range exceeds valid bounds"]),
    ("integer-param", "param w: i32[2] = zeros()\n", None, "1:10",
     ["params are float tensors"]),
    ("unknown-dtype", "input x: f64[2]\n", None, "1:10",
     ["'f64' is not a dtype (did you mean f16?)"]),
    ("non-exact-division", "config {\n  d = 64\n  heads = 3\n}\ninput x: f32[2, d/heads]\n", None, "5:17",
     ["64 / 3 is not an exact integer division (remainder 1)"]),
    ("non-exact-division-in-config", "config {\n  d = 10\n  half = d / 4\n}\n", None, "3:10",
     ["10 / 4 is not an exact integer division"]),
    ("unknown-config-name-in-shape", "config { hidden = 8 }\ninput x: f32[2, hiden]\n", None, "2:17",
     ["unknown name 'hiden' (did you mean hidden?)"]),
    ("bad-dimension", "config { rate = 0.5 }\ninput x: f32[rate]\n", None, "2:14",
     ["a shape dimension must be a positive integer, got float 0.5"]),
    ("override-unknown-key", "config {\n  hidden = 8\n}\n", {"hiden": "3"}, None,
     ["config override hiden=3: unknown config key 'hiden' (did you mean hidden?)", "config keys: hidden"]),
    ("override-wrong-type", "config {\n  hidden = 8\n}\n", {"hidden": "2.5"}, "2:3",
     ["config override hidden=2.5: hidden is an int (declared as 8 here), got '2.5'"]),
    ("override-wrong-type-python", "config {\n  on = true\n}\n", {"on": 3}, "2:3",
     ["config override on=3: on is a bool (true or false) (declared as true here), got int 3"]),
    ("override-bad-dtype", "config {\n  t = f32\n}\n", {"t": "f64"}, "2:3",
     ["t is a dtype (f32, f16, i32)", "got 'f64'"]),
    ("split-not-divisible", "input x: f32[2, 10]\na, b, c = split(x, 3)\n", None, "2:20",
     ["split(): axis -1 has size 10, which does not split into 3 equal parts"]),
    ("tuple-arity", "input x: f32[2, 9]\na, b = split(x, 3)\n", None, "2:1",
     ["the right side gives 3 values, but 2 names are assigned"]),
    ("repeat-not-a-block", "block layer(x) {\n  return x\n}\ninput x: f32[2]\ny = repeat(2, layr, x)\n", None,
     "5:15", ["repeat(): 'layr' is not a block (did you mean layer?)"]),
    ("block-recursion", "block b(x) {\n  return b(x)\n}\ninput x: f32[2]\ny = b(x)\n", None, "2:10",
     ["block 'b' calls itself (b -> b)"]),
    ("block-arity", "block b(x, y) {\n  return x + y\n}\ninput x: f32[2]\ny = b(x)\n", None, "5:5",
     ["b() is missing its argument 'y'"]),
    ("block-parameter-is-config-key", "config { d = 2 }\nblock b(d) {\n  return d\n}\n", None, "2:9",
     ["block 'b': parameter 'd' is a config key"]),
    ("output-name-rebound", "input x: f32[2]\ny = x * 2.0\noutput y\ny = y + x\noutput y\n", None, "5:8",
     ["'y' is already an output, of another value"]),
    ("block-without-return", "block b(x) {\n  y = x\n}\n", None, "1:7", ["block 'b' has no `return`"]),
    ("block-sees-no-globals", "input x: f32[2]\nblock b(y) {\n  return y + x\n}\nz = b(x)\n", None, "3:14",
     ["unknown name 'x'", "hint: a block sees only its arguments"]),
    ("initialiser-as-op", "input x: f32[2]\ny = xavier()\n", None, "2:5",
     ["xavier() is an initialiser"]),
    ("non-ascii-digit", "input x: f32[\uff18]\n", None, "1:14", ["syntax error: unexpected character '\uff18'"]),
    ("string-plus-dtype", "config {\n  a = 'x' + f32\n}\n", None, "2:7",
     ["cannot apply '+' to str 'x' and dtype f32"]),
    ("train-unknown-name", "config { lr = 0.1 }\ntrain {\n  optimizer = adam(lr=lrr)\n}\n", None, "3:23",
     ["unknown name 'lrr' in train section (did you mean lr?)"]),
]


def error_of(src: str, config=None) -> FlowError:
    with pytest.raises(FlowError) as info:
        fg.loads(src, config, file=FILE)
    return info.value


def assert_no_traceback_chain(err: BaseException):
    # raised as itself: no "During handling of the above exception" chain from Lark or the builder
    assert err.__cause__ is None
    assert err.__context__ is None or err.__suppress_context__


@pytest.mark.parametrize("case_id, src, config, where, fragments", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case_id, src, config, where, fragments):
    err = error_of(src, config)
    text = str(err)
    first = text.splitlines()[0]
    if where is None:
        assert err.span is None and not first.startswith(FILE)
    else:
        line, col = map(int, where.split(":"))
        assert first.startswith(f"{FILE}:{line}:{col}: "), text
        assert (err.span.file, err.span.line, err.span.col) == (FILE, line, col)
        # the source line and a caret under the column
        src_line = src.splitlines()[line - 1]
        assert f"    {src_line}\n    {' ' * (col - 1)}^" in text, text
    for fragment in fragments:
        assert fragment in text, text
    assert_no_traceback_chain(err)


@pytest.mark.parametrize("src", [
    "block f(a) {\n  h = a +* a\n  return h\n}\n",
    "config {\n  a = = 1\n}\n",
    "train {\n  steps 10\n}\n",
    "config {\n  a = \"(\"\n  b = = 2\n}\n",
])
def test_a_syntax_error_inside_braces_closed_later_blames_no_bracket(src):
    # the { } is open where the error is, but it is closed: not the cause
    err = error_of(src)
    assert err.span.line > 1 and "never closed" not in str(err), str(err)


@pytest.mark.parametrize("src, where, hint", [
    ("block f(a) {\n  return a\ninput x: f32[2]\n", "3:7", "the '{' at line 1, column 12 is never closed"),
    ("config {\n  a = 1\n", "2:8", "the '{' at line 1, column 8 is never closed"),
    ("config {\n  a = (1\n  b = 2\n}\n", "3:3", "the '(' at line 2, column 7 is never closed"),
    ("block f(a) {\n  h = relu(a\n  return h\n}\n", "3:3", "the '(' at line 2, column 11 is never closed"),
])
def test_a_bracket_never_closed_is_named(src, where, hint):
    err = error_of(src)
    assert f"{err.span.line}:{err.span.col}" == where and f"hint: {hint}" in str(err), str(err)


def test_at_least_twenty_distinct_bad_inputs():
    assert len({c[1] + repr(c[2]) for c in CASES}) >= 20


def test_error_inside_a_block_notes_the_repeat_line():
    src = """\
config { d = 4 }
block lin(x) {
  param w: f32[d, 3] = xavier()
  return x @ w
}
input x: f32[2, d]
y = repeat(2, lin, x)
"""
    err = error_of(src)
    text = str(err)
    assert text.startswith(f"{FILE}:4:10: matmul:"), text
    assert "f32[2,3]" in text and "f32[4,3]" in text          # instance 1 gets instance 0's [2, 3]
    assert f"  note: expanded from {FILE}:7:5\n    y = repeat(2, lin, x)\n        ^" in text
    assert [(s.line, s.col) for s in err.span.via] == [(7, 5)]


def test_an_initialiser_argument_from_a_block_argument_is_checked_at_load():
    """normal(std=s) with s = -0.0 passed `flowgrad check`; compile then
    raised numpy's raw ValueError (scale < 0)."""
    src = """\
block lin(x, s) {
  param w: f32[3, 2] = normal(std=s)
  return x @ w
}
input x: f32[4, 3]
y = lin(x, -0.0)
"""
    err = error_of(src)
    text = str(err)
    assert text.startswith(f"{FILE}:2:35: normal(): std must be >= 0, got -0.0"), text
    assert f"  note: expanded from {FILE}:6:5\n    y = lin(x, -0.0)\n        ^" in text
    assert_no_traceback_chain(err)


def test_error_in_a_nested_block_notes_every_call_site():
    src = """\
block inner(x) {
  return x + nothing
}
block outer(x) {
  return inner(x)
}
input x: f32[2]
y = outer(x)
"""
    err = error_of(src)
    text = str(err)
    assert text.startswith(f"{FILE}:2:14: unknown name 'nothing'")
    assert text.index(f"note: expanded from {FILE}:5:10") < text.index(f"note: expanded from {FILE}:8:5")


# ---------------------------------------------------------------- errors at step time (api.py)

SMALL = """
input x: f32[2, 3]
input k: i32[2]
param w: f32[3] = ones()
y = x * w
output y
"""


def test_step_without_minimize_when_gradients_are_asked_for():
    sess = fg.loads(SMALL, file=FILE).compile(device="cpu")
    feeds = {"x": np.ones((2, 3)), "k": np.zeros(2, dtype=np.int32)}
    with pytest.raises(FlowError, match=r"has no `minimize` statement.*grads=False"):
        sess.step(feeds)
    out = sess.step(feeds, grads=False)          # forward only is fine
    assert out.outputs["y"].shape == (2, 3) and out.grads == {}


@pytest.mark.parametrize("feeds, where, message", [
    ({"x": np.ones((3, 2)), "k": np.zeros(2, np.int32)}, "2:1",
     "feed 'x' has shape [3, 2], but input x is f32[2,3]"),
    ({"x": np.ones((2, 3)), "k": np.zeros(2, np.float32)}, "3:1",
     "feed 'k' has dtype float32, but input k is i32[2]"),
    ({"x": np.ones((2, 3), dtype=np.int64), "k": np.zeros(2, np.int32)}, "2:1",
     "feed 'x' has dtype int64, but input x is f32[2,3]"),
    ({"x": np.ones((2, 3))}, "3:1", "missing feed for input 'k' (i32[2])"),
])
def test_step_with_a_bad_feed(feeds, where, message):
    sess = fg.loads(SMALL, file=FILE).compile(device="cpu")
    with pytest.raises(FlowError) as info:
        sess.step(feeds, grads=False)
    assert str(info.value).startswith(f"{FILE}:{where}: {message}"), str(info.value)


def test_step_with_an_unknown_feed():
    sess = fg.loads(SMALL, file=FILE).compile(device="cpu")
    with pytest.raises(FlowError, match="feed 'z' is not an input of bad"):
        sess.step({"x": np.ones((2, 3)), "k": np.zeros(2, np.int32), "z": 1}, grads=False)


# ---------------------------------------------------------------- fuzz: nothing but FlowError

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


MODELS = Path(__file__).resolve().parent.parent / "models"
SOURCES = [(MODELS / name).read_text() for name in ("mlp.flow", "tiny_gpt.flow")]
PIECES = list("()[]{},=:+-*/@#\"'\n .0123456789") + ["**", "model", "input", "param", "block", "return",
                                                     "output", "minimize", "train", "config", "f32", "i32",
                                                     "split", "repeat", "decoder", "x", "1e-3", "true"]


@st.composite
def mutated_source(draw):
    text = draw(st.sampled_from(SOURCES))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text)))
        j = min(len(text), i + draw(st.integers(0, 6)))
        text = text[:i] + draw(st.sampled_from(PIECES + [""])) + text[j:]
    return text


@settings(max_examples=300, deadline=None)
@given(mutated_source())
def test_mutated_models_build_or_raise_flow_error(src):
    try:
        fg.loads(src, file=FILE)
    except FlowError as err:
        text = str(err)
        assert text and "Traceback" not in text
        if err.span is not None:
            assert err.span.file == FILE and err.span.line >= 1 and err.span.col >= 1
        assert_no_traceback_chain(err)


@pytest.mark.parametrize("device", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_out_of_range_indices_in_a_feed_are_refused_before_the_step(device, request):
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    sess = fg.load(MODELS / "tiny_gpt.flow").compile(device=device)
    tokens = np.zeros((32, 16), np.int32)
    targets = np.zeros((32, 16), np.int32)
    tokens[2, 3] = 16
    with pytest.raises(fg.FlowError) as e:
        sess.step({"tokens": tokens, "targets": targets})
    assert "feed 'tokens' holds 16 at [2, 3], out of range for embedding at" in str(e.value)
    assert "tiny_gpt.flow:43:5 (valid: 0..15)" in str(e.value)
    tokens[2, 3] = 0
    targets[0, 0] = -1
    with pytest.raises(fg.FlowError, match=r"feed 'targets' holds -1 at \[0, 0\], out of range for cross_entropy"):
        sess.step({"tokens": tokens, "targets": targets})


@pytest.mark.parametrize("dtype, literal, largest", [("f32", "1e39", "3.40282e+38"), ("f16", "-1e9", "65504"),
                                                     ("mixed", "-1e9", "65504")])
def test_a_number_past_its_tensors_float_range_is_an_error(dtype, literal, largest):
    """It became an inf: `(1 - m) * -1e9` in f16, then 0 * -inf = NaN in the masked rows."""
    with pytest.raises(FlowError) as e:   # f32 fails as the model loads (it builds in f32 then)
        fg.loads(f"model t\ninput x: f32[2]\ninput m: f32[2]\ny = x + (1.0 - m) * {literal}\noutput y\n").build(dtype)
    assert e.value.message.endswith(f"outside the range of the {'f32' if dtype == 'f32' else 'f16'} tensor it "
                                    f"meets (largest {largest})") and e.value.span.where() == "<string>:4:21"
    model_ok = fg.loads("model t\ninput x: f32[2]\ninput m: f32[2]\ny = x + (1.0 - m) * -3e4\noutput y\n")
    model_ok.build(dtype)


def test_reducing_over_an_empty_axis_list_is_refused():
    """numpy reduces no axis, PyTorch every axis: sum(x, axis=[]) gave x unchanged."""
    with pytest.raises(FlowError, match=r"sum: axis=\[\] is ambiguous"):
        fg.loads("model t\ninput x: f32[2, 3]\ny = sum(x, axis=[])\noutput y\n")


def test_float_is_reserved_as_the_compile_dtypes_name():
    """A config key `float` silently changed what cast(x, float) casts to."""
    with pytest.raises(FlowError, match="'float' is a reserved name and cannot be a config key"):
        fg.loads("model t\nconfig {\n  float = 3\n}\ninput x: f32[2]\ny = cast(x, float)\noutput y\n")


def test_arithmetic_on_a_train_sections_call_names_the_call():
    with pytest.raises(FlowError, match=r"cannot apply '\+' to call adam\(\.\.\.\) and int 1"):
        fg.loads("model t\ninput x: f32[2]\nparam w: f32[2] = ones()\nl = sum(x * w)\nminimize l\n"
                 "train {\n  steps = adam() + 1\n}\n")


def test_a_name_assigned_twice_in_one_statement_is_an_error():
    with pytest.raises(FlowError, match="'a' is assigned twice in one statement") as e:
        fg.loads("model t\ninput x: f32[4]\na, a = split(x, 2)\noutput a\n")
    assert e.value.span.where() == "<string>:3:4"
