"""The language's size limits, API misuse and odd source text: each is one
FlowError, positioned where the file is to blame, never a traceback, a hang
or an allocation that takes the machine down."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.dsl import limits
from flowgrad.errors import FlowError

BLOCK = "input x: f32[4]\nblock b(a) {\n  return relu(a)\n}\n"


def err(text, config=None, file="lim.flow"):
    with pytest.raises(FlowError) as e:
        fg.loads(text, config, file=file)
    return e.value


def at(e, line, col=None):
    assert e.span is not None, str(e)
    assert e.span.line == line, str(e)
    if col is not None:
        assert e.span.col == col, str(e)
    str(e)  # the message itself renders


def test_repeat_count_limit():
    e = err(BLOCK + "y = repeat(1000000000, b, x)\n")
    at(e, 5, 12)
    assert f"limit of {limits.MAX_REPEAT:,}" in e.message


def test_repeat_count_from_set_is_refused():
    e = err("config {\n  n = 2\n}\n" + BLOCK + "y = repeat(n, b, x)\n", {"n": "1000000000"})
    at(e, 8)


def test_nested_blocks_doubling_hit_the_node_bound(monkeypatch):
    monkeypatch.setattr(limits, "MAX_NODES", 5000)  # the mechanism, at a size a test can afford
    lines = ["input x: f32[2]", "block b0(a) {", "  return a * 2.0", "}"]
    for i in range(1, 31):
        lines += [f"block b{i}(a) {{", f"  return b{i - 1}(b{i - 1}(a))", "}"]
    e = err("\n".join(lines + ["y = b30(x)", "output y"]) + "\n")
    assert "nodes" in e.message and e.span is not None


def test_split_into_more_parts_than_the_node_bound():
    # one slice node a part: a short split(x, n) must not build n nodes first
    n = limits.MAX_NODES + 1
    e = err(f"input x: f32[{n}]\nparts = split(x, {n})\n")
    at(e, 2, 18)
    assert "nodes" in e.message


def test_block_call_depth_limit():
    lines = ["input x: f32[2]", "block b0(a) {", "  return a", "}"]
    for i in range(1, 60):
        lines += [f"block b{i}(a) {{", f"  return b{i - 1}(a)", "}"]
    e = err("\n".join(lines + ["y = b59(x)"]) + "\n")
    assert "deep" in e.message and e.span is not None


@pytest.mark.parametrize("nesting", ["relu({})", "softmax(x={})", "-{}", "{} + a"])
def test_deep_expressions_in_nested_blocks_at_the_limits_build(nesting):
    # each limit alone is fine; a block call at the bottom of a deep
    # expression in each of the nested blocks multiplies them
    import sys

    inner = "b{}(a)"
    for _ in range(limits.MAX_DEPTH - 1):
        inner = nesting.format(inner)
    n = limits.MAX_BLOCK_DEPTH - 1
    lines = ["input x: f32[2]", f"block b{n}(a) {{", "  return a", "}"]
    for i in range(n):
        lines += [f"block b{i}(a) {{", "  return " + inner.replace("b{}", f"b{i + 1}"), "}"]
    before = sys.getrecursionlimit()
    m = fg.loads("\n".join(lines + ["y = b0(x)", "output y"]) + "\n")
    assert "y" in m.graph.outputs
    assert sys.getrecursionlimit() == before


@pytest.mark.parametrize("n", [150, 2000])
def test_long_sum_chain_is_a_positioned_error(n):
    e = err("input x: f32[2]\ny = " + " + ".join(["x"] * n) + "\n")
    at(e, 2)
    assert "nested more than" in e.message


def test_sum_chain_under_the_limit_builds():
    n = limits.MAX_DEPTH - 5
    m = fg.loads("input x: f32[2]\ny = " + " + ".join(["x"] * n) + "\noutput y\n")
    out = m.compile(device="cpu").step({"x": np.ones(2, np.float32)}, grads=False).outputs["y"]
    np.testing.assert_array_equal(out, [n] * 2)


def test_deep_calls():
    e = err("input x: f32[2]\ny = " + "relu(" * 5000 + "x" + ")" * 5000 + "\n")
    at(e, 2)


def test_deep_parentheses_add_no_nesting():
    m = fg.loads("input x: f32[2]\ny = " + "(" * 5000 + "x" + ")" * 5000 + "\noutput y\n")
    assert m.graph.outputs["y"] == m.graph.inputs["x"]


def test_deep_config_expression():
    e = err("config {\n  a = " + "-" * 3000 + "1\n}\n")
    at(e, 2)


NESTINGS = {
    "sum chain": lambda n: " + ".join(["a"] * (n + 1)),
    "negations": lambda n: "-" * n + "a",
    "calls": lambda n: "relu(" * n + "a" + ")" * n,
    "mixed": lambda n: "relu(" * (n // 2) + "-" * (n - n // 2) + "a" + ")" * (n // 2),
}
PLACES = {
    "statement": lambda e: f"input a: f32[2]\ny = {e}\noutput y\n",
    "block": lambda e: f"input x: f32[2]\nblock b(a) {{\n  return {e}\n}}\ny = b(x)\noutput y\n",
}


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("nesting", NESTINGS)
def test_nesting_limit_is_the_same_for_every_expression_and_place(nesting, place):
    # the limit counts expression levels only: not the statement, block or
    # argument list around them (a call nests once)
    fg.loads(PLACES[place](NESTINGS[nesting](limits.MAX_DEPTH)))
    e = err(PLACES[place](NESTINGS[nesting](limits.MAX_DEPTH + 1)))
    assert "nested more than" in e.message


@pytest.mark.parametrize("literal", ["9" * 5000, "1" + "0" * 40, "1e400"])
def test_number_literal_limits(literal):
    e = err(f"config {{\n  a = {literal}\n}}\n")
    at(e, 2, 7)


def test_huge_static_power_is_refused_without_computing_it():
    e = err("config {\n  a = 10 ** 1000000000\n}\n")
    at(e, 2)
    e = err("config {\n  a = 10.0 ** 1000\n}\n")
    at(e, 2)


@pytest.mark.parametrize("expr", ["1e308 * 10", "1e308 + 1e308", "-1e308 - 1e308", "1 / 1e-320"])
def test_static_float_arithmetic_stays_finite(expr):
    e = err(f"config {{\n  a = {expr}\n}}\n")
    at(e, 2, 7)
    assert "out of a float's range" in e.message
    e = err(f"param w: f32[2] = normal(std={expr})\n")
    at(e, 1, 30)


@pytest.mark.parametrize("value", ["9" * 5000, "99999999999999999999999", 2**70, "x" * 10000])
def test_set_value_limits(value):
    e = err("config {\n  n = 2\n}\n", {"n": value})
    at(e, 2)


def test_set_float_must_be_finite():
    e = err("config {\n  lr = 0.1\n}\n", {"lr": "inf"})
    at(e, 2)


def test_rank_limit():
    e = err("input x: f32[" + ", ".join(["1"] * 9) + "]\n")
    at(e, 1)
    assert "at most 8 axes" in e.message
    e = err("input x: f32[2]\ny = reshape(x, shape=[" + ", ".join(["1"] * 40) + ", 2])\n")
    at(e, 2)


def test_elements_per_tensor_limit():
    e = err("input x: f32[65536, 65536]\n")
    at(e, 1)
    assert "elements" in e.message


def test_host_memory_is_checked_before_allocating(monkeypatch):
    from flowgrad.host_memory import check_host_memory

    m = fg.loads("config {\n  n = 4\n}\ninput x: f32[n]\nparam w: f32[n, 1000] = normal()\ny = sum(x @ w)\n"
                 "minimize y\n", {"n": 1_000_000}, file="big.flow")
    with pytest.raises(FlowError) as e:
        check_host_memory(m.graph, budget=2**30)
    at(e.value, 5)
    assert "w" in e.value.message and "GiB" in e.value.message
    import flowgrad.host_memory as hm

    monkeypatch.setattr(hm, "host_budget", lambda: 2**30)   # compile checks before initialising params
    with pytest.raises(FlowError, match="host memory"):
        fg.load("flowgrad/models/mlp.flow", {"hidden": 2_000_000}).compile(device="cpu")


def test_non_utf8_file(tmp_path):
    path = tmp_path / "latin.flow"
    path.write_bytes(b"input x: f32[2]\n# caf\xe9\ny = relu(x)\n")
    with pytest.raises(FlowError) as e:
        fg.load(path)
    at(e.value, 2, 6)
    assert "UTF-8" in e.value.message


@pytest.mark.parametrize("sep", ["\x0c", "\x85", "\u2028", "\x0b"])
def test_caret_after_unusual_whitespace(sep):
    text = f"input x: f32[2]  # a{sep}b\ny = relu(x) $ 2\n"
    e = err(text)
    at(e, 2, 13)
    assert e.span.text == "y = relu(x) $ 2"


def test_crlf_lines_and_a_lone_carriage_return():
    e = err("input x: f32[2]\r\ny = x $ 2\r\n")
    at(e, 2, 7)
    assert e.span.text == "y = x $ 2"
    e = err("input x: f32[2]\ny = x\r+ 1\n")
    at(e, 2, 6)
    assert "\r" not in str(e)


def test_loads_takes_bytes_and_refuses_other_types():
    assert fg.loads(b"input x: f32[2]\n").graph.inputs
    for bad in (None, 3, ["input x: f32[2]"]):
        with pytest.raises(FlowError):
            fg.loads(bad)
    with pytest.raises(FlowError):
        fg.loads("input x: f32[2]\n", config=[("a", 1)])


@pytest.fixture
def mlp():
    return fg.load("flowgrad/models/mlp.flow", {"batch": 4})


def feeds_for(model):
    return {"x": np.zeros((4, 64), np.float32), "y": np.zeros(4, np.int32)}


@pytest.mark.parametrize("kwargs", [{"backward": "foo"}, {"backward": None}, {"seed": -1}, {"seed": 2**70},
                                    {"seed": "1"}, {"seed": True}, {"dtype": None}, {"device": None},
                                    {"device": 0}])
def test_compile_misuse(mlp, kwargs):
    with pytest.raises(FlowError):
        mlp.compile(**{"device": "cpu", **kwargs})


@pytest.mark.parametrize("feeds", [None, [], "x", 3])
def test_step_feeds_not_a_dict(mlp, feeds):
    with pytest.raises(FlowError, match="feeds must be a dict"):
        mlp.compile(device="cpu").step(feeds)


@pytest.mark.parametrize("change", [{"x": None}, {"x": "abc"}, {3: np.zeros(2)}, {"x": [[1, "a"]]},
                                    {"x": np.zeros((4, 64), object)}, {"x": np.zeros((4, 64), np.complex64)}])
def test_bad_feed_values(mlp, change):
    feeds = {**feeds_for(mlp), **change}
    with pytest.raises(FlowError):
        mlp.compile(device="cpu").step(feeds)


def test_int_feed_out_of_i32_range_does_not_wrap():
    m = fg.loads("input i: i32[2]\ny = cast(i, f32)\noutput y\n", file="ints.flow")
    sess = m.compile(device="cpu")
    with pytest.raises(FlowError, match="outside the i32 range") as e:
        sess.step({"i": np.array([1, 2**32 + 1], np.int64)}, grads=False)
    at(e.value, 1)
    assert sess.step({"i": np.array([1, -5], np.int64)}, grads=False).outputs["y"].tolist() == [1, -5]


def test_set_params_misuse(mlp):
    sess = mlp.compile(device="cpu")
    for bad in (None, [1], {3: 1}, {"w1": np.empty((64, 128), object)}, {"w1": "abc"},
                {"w1": np.zeros((64, 128), np.complex64)}):
        with pytest.raises(FlowError):
            sess.set_params(bad)


@pytest.mark.parametrize("kwargs", [{"grads": "yes"}, {"grads": None}, {"train": 1}, {"grad_inputs": "no"}])
def test_step_flags_must_be_booleans(mlp, kwargs):
    # found by the fuzzer: grads="yes" reached the random-state feed as int("yes")
    with pytest.raises(FlowError, match="must be True or False"):
        mlp.compile(device="cpu").step(feeds_for(mlp), **kwargs)


def test_step_optimizer_must_be_an_optimizer(mlp):
    with pytest.raises(FlowError, match="optimizer"):
        mlp.compile(device="cpu").step(feeds_for(mlp), optimizer="sgd")


def test_found_by_the_fuzzer():
    # an int literal past i32 meeting an i32 tensor
    e = err("input i: i32[2]\ny = i + 2147483648\n")
    at(e, 2, 9)
    # a NUL byte in a string literal
    e = err('config {\n  s = "a\x00b"\n}\n')
    at(e, 2, 7)
