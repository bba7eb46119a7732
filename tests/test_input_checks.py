"""Bad input named where it came from: a nan in a data file (not a learning
rate problem), numpy's floating-point warnings kept out of a diverging run,
a resume on another model's run, --steps out of range, a file starting with a
byte-order mark, keywords as names, and the docs' error examples."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.cli import main as cli_main
from flowgrad.dsl.config import parse_sets
from flowgrad.dsl.parser import keyword_names
from flowgrad.errors import FlowError
from flowgrad.training.section import check_train
from flowgrad.training.tabular import INF_HINT, NA_HINT

ROOT = Path(__file__).resolve().parent.parent

# line 14 is the data source, line 15 `steps = 4`
TINY = """model tiny
config {
  batch = 4
}
input x: f32[batch, 2]
input y: i32[batch]
param w1: f32[2, 8] = xavier()
param w2: f32[8, 3] = xavier()
logits = relu(x @ w1) @ w2
loss = cross_entropy(logits, y)
minimize loss
output logits
train {
  data = DATA
  steps = 4
  optimizer = sgd(lr=0.1)
}
"""


def tiny(tmp_path, data='csv("rows.csv", y="label", val_fraction=0, test_fraction=0.25)', name="tiny", steps=4,
         optimizer="sgd(lr=0.1)"):
    text = (TINY.replace("DATA", data).replace("model tiny", f"model {name}").replace("steps = 4", f"steps = {steps}")
            .replace("sgd(lr=0.1)", optimizer))
    path = tmp_path / f"{name}.flow"
    path.write_text(text)
    return path


def write_rows(tmp_path, bad_cell=None):
    """rows.csv: 16 rows of a, b, label; bad_cell = (row, column, text)."""
    rows = [[str(i % 5 * 0.1), str(i % 3 * 0.2), str(i % 3)] for i in range(16)]
    if bad_cell is not None:
        r, c, text = bad_cell
        rows[r][c] = text
    (tmp_path / "rows.csv").write_text("a,b,label\n" + "".join(",".join(r) + "\n" for r in rows))


# -- 1. non-finite values in data files ---------------------------------------------

@pytest.mark.parametrize("cell, column, why, hint", [
    ((1, 0, "nan"), "a", "a missing value", NA_HINT),
    ((5, 1, "-inf"), "b", "not a finite number", INF_HINT),
    ((2, 2, "nan"), "label", "a missing value", NA_HINT),
])
def test_a_non_finite_csv_cell_is_named_by_file_line_and_column(tmp_path, cell, column, why, hint):
    write_rows(tmp_path, cell)
    model = fg.load(tiny(tmp_path))
    line = cell[0] + 2   # the header is line 1
    want = f"data csv(): {tmp_path / 'rows.csv'}:{line}: column {column!r} holds {cell[2]!r}, {why}"
    with pytest.raises(FlowError) as e:
        fg.train(model, device="cpu", progress=False)
    assert e.value.message == want
    assert e.value.span.line == 14 and e.value.hint == hint
    assert [err.message for err in check_train(model.graph)] == [want]   # what `flowgrad check` lists


def test_flowgrad_check_reports_the_nan_instead_of_train_ok(tmp_path, capsys):
    write_rows(tmp_path, (3, 0, "nan"))
    rc = cli_main(["check", str(tiny(tmp_path))])
    shown = capsys.readouterr()
    assert rc != 0
    assert "rows.csv:5: column 'a' holds 'nan', a missing value" in shown.err
    assert "train   ok" not in shown.out + shown.err


def test_a_non_finite_value_in_an_npz_or_npy_names_the_array_and_its_index(tmp_path):
    x = np.ones((16, 2), np.float32)
    x[6, 1] = np.inf
    y = np.arange(16) % 3
    np.savez(tmp_path / "d.npz", feats=x, y=y)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    with pytest.raises(FlowError) as e:
        fg.train(fg.load(tiny(tmp_path, 'npz("d.npz", x="feats", val_fraction=0)')), device="cpu", progress=False)
    assert e.value.message == (f"data npz(): {str(tmp_path / 'd.npz')!r}: array 'feats' holds inf at row 6, "
                               "column 1 (0-based), not a finite number")
    with pytest.raises(FlowError) as e:
        fg.train(fg.load(tiny(tmp_path, 'npy("x.npy", "y.npy", val_fraction=0)')), device="cpu", progress=False)
    assert e.value.message == (f"data npy(): {str(tmp_path / 'x.npy')!r}: array 'x' holds inf at row 6, "
                               "column 1 (0-based), not a finite number")


def test_finite_data_still_trains(tmp_path):
    write_rows(tmp_path)
    assert fg.train(fg.load(tiny(tmp_path)), device="cpu", progress=False).steps == 4


# -- 2. numpy's warnings on divergence --------------------------------------------

def test_a_diverging_run_gives_one_error_and_no_numpy_warnings(tmp_path):
    write_rows(tmp_path)
    model = fg.load(tiny(tmp_path, steps=30, optimizer="adam(lr=1e30)"))
    before = np.geterr()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(FlowError) as e:
            fg.train(model, device="cpu", progress=False)
    assert re.fullmatch(r"the loss became (nan|inf) at step \d+: training diverged", e.value.message)
    assert [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)] == []
    assert np.geterr() == before   # silenced for the steps only


# -- 3. resuming another model's run ----------------------------------------------

def test_resume_on_another_models_run_names_both_models(tmp_path):
    write_rows(tmp_path)
    fg.train(fg.load(tiny(tmp_path, name="first")), device="cpu", progress=False, out=tmp_path / "run")
    other = fg.load(tiny(tmp_path, name="second"))
    with pytest.raises(FlowError) as e:
        fg.train(other, device="cpu", progress=False, out=tmp_path / "run", resume=True)
    assert e.value.message == (f"cannot resume {tmp_path / 'run' / 'checkpoint.safetensors'}: it was written by "
                               "model first, not second")
    assert e.value.hint == "resume with model first, or start a new --out"


# -- 4. --steps out of range --------------------------------------------------------

@pytest.mark.parametrize("steps", [-3, 0])
def test_bad_steps_from_the_caller_name_the_caller(tmp_path, capsys, steps):
    write_rows(tmp_path)
    with pytest.raises(FlowError) as e:
        fg.train(fg.load(tiny(tmp_path)), steps=steps, device="cpu", progress=False)
    assert str(e.value) == f"train(steps=...): steps must be >= 1, got {steps}" and e.value.span is None
    rc = cli_main(["train", str(tiny(tmp_path)), "--steps", str(steps), "--device", "cpu", "--out",
                   str(tmp_path / "run")])
    assert rc != 0
    assert capsys.readouterr().err.splitlines()[0] == f"error: --steps must be at least 1, got {steps}"


def test_bad_steps_in_the_file_point_at_the_file(tmp_path):
    write_rows(tmp_path)
    path = tiny(tmp_path, steps=0)
    with pytest.raises(FlowError) as e:
        fg.train(fg.load(path), device="cpu", progress=False)
    assert str(e.value).splitlines()[0] == f"{path}:15:3: train: steps must be >= 1, got 0"
    # --steps replaces the file's value, so the file's is not checked then
    assert fg.train(fg.load(path), steps=2, device="cpu", progress=False).steps == 2


# -- 5. a byte-order mark -----------------------------------------------------------

BOM = b"\xef\xbb\xbf"
MINI = "model m\ninput x: f32[2]\nparam w: f32[2] = zeros()\nloss = sum(x * w)\nminimize loss\n"


@pytest.mark.parametrize("as_bytes", [True, False])
def test_a_leading_byte_order_mark_is_accepted(as_bytes):
    text = BOM + MINI.encode() if as_bytes else "\ufeff" + MINI
    assert fg.loads(text, file="bom.flow").graph.name == "m"


def test_positions_after_a_byte_order_mark_count_from_the_first_real_character(tmp_path):
    path = tmp_path / "bom.flow"
    path.write_bytes(BOM + b"y = q\n" + MINI.encode())
    with pytest.raises(FlowError) as e:
        fg.load(path)
    assert str(e.value).splitlines()[:3] == [f"{path}:1:5: unknown name 'q'", "    y = q", "        ^"]
    path.write_bytes(BOM + b"model m\xff\n")
    with pytest.raises(FlowError) as e:
        fg.load(path)
    assert str(e.value).splitlines()[0] == (f"{path}:1:8: the file is not UTF-8 text: byte 0xff cannot be "
                                            "decoded")


# -- 6. keywords are reserved -------------------------------------------------------

@pytest.mark.parametrize("line, message", [
    ("config { input = 3 }", "3:10: 'input' is a keyword and cannot be a config key"),
    ("config { state = 3 }", "3:10: 'state' is a keyword and cannot be a config key"),
    ("param output: f32[2] = zeros()", "3:7: 'output' is a keyword and cannot name a param"),
    ("a, train = split(x, 2)", "3:4: 'train' is a keyword and cannot name a value"),
    ("block f(model) { return model }", "3:9: block 'f': parameter 'model' is a keyword"),
    ("block minimize(a) { return a }", "3:7: 'minimize' is a keyword and cannot name a block"),
    ("config { true = 3 }", "3:10: 'true' is a reserved name and cannot be a config key"),
])
def test_a_keyword_as_a_name_is_a_positioned_error(line, message):
    text = MINI.replace("input x: f32[2]\n", f"input x: f32[2]\n{line}\n")
    with pytest.raises(FlowError) as e:
        fg.loads(text, file="k.flow")
    assert str(e.value).splitlines()[0] == f"k.flow:{message}"


def test_the_docs_list_the_grammars_keywords():
    doc = (ROOT / "docs" / "language.md").read_text()
    listed = re.search(r"Reserved: the keywords `([^`]*)`", doc.replace("\n  ", " ")).group(1).split()
    assert sorted(listed) == sorted(keyword_names())


# -- 7. the docs' example of an error inside a block --------------------------------

def test_the_block_error_example_in_the_docs_is_what_flowgrad_prints():
    doc = (ROOT / "docs" / "language.md").read_text()
    code = re.search(r"```flow\n(model stack\n.*?)```", doc, re.S).group(1)
    with pytest.raises(FlowError) as e:
        fg.loads(code, {"heads": 5}, file="stack.flow")
    shown = re.search(r"```\n(stack\.flow:.*?)\n```", doc, re.S).group(1)
    assert str(e.value) == shown



# the sources behind the errors docs/language.md shows under "Errors", in its order
LANGUAGE_DOC_ERRORS = [
    "input x: f32[4, 2]\ny = relo(x)\noutput y\n",
    "input x: f32[4, 2]\noutput x y\n",
    "input x: f32[2, 3]\nparam w: f32[4, 5] = zeros()\ny = x @ w\noutput y\n",
    "input x: f32[4, 2]\nminimize x\n",
]


def test_the_error_examples_in_the_language_doc_are_what_flowgrad_prints():
    doc = (ROOT / "docs" / "language.md").read_text()
    shown = re.search(r"## Errors\n.*?```\n(.*?)\n```", doc, re.S).group(1)
    printed = []
    for text in LANGUAGE_DOC_ERRORS:
        with pytest.raises(FlowError) as e:
            fg.loads(text, file="bad.flow")
        printed.append(str(e.value))
    assert "\n".join(printed) == shown
    # the config override example: the `configured` model's d, set from the command line
    code = re.search(r"```flow\n(model configured\n.*?)```", doc, re.S).group(1)
    with pytest.raises(FlowError) as e:
        fg.loads(code, parse_sets(["d=2.5"]), file="model.flow")
    shown = re.search(r"```\n(model\.flow:.*?)\n```", doc, re.S).group(1)
    assert str(e.value) == shown


def test_the_readme_check_error_is_what_flowgrad_check_prints(tmp_path, capsys, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"```\n\$ flowgrad check bad\.flow\n(.*?)\n```", readme, re.S).group(1)
    text = (ROOT / "models" / "mlp.flow").read_text()
    (tmp_path / "bad.flow").write_text(text.replace("param w1: f32[inputs, hidden]", "param w1: f32[32, hidden]"))
    monkeypatch.chdir(tmp_path)
    assert cli_main(["check", "bad.flow"]) == 1
    assert capsys.readouterr().err.rstrip("\n") == shown

def test_array_data_from_python_takes_lists_and_refuses_bad_fractions():
    data = fg.ArrayData.split({"x": [[1.0, 2.0]] * 10, "y": [0, 1] * 5}, 0.1, 0.2, seed=0, describe="lists")
    assert data.size("train") + data.size("val") + data.size("test") == 10
    with pytest.raises(FlowError, match=r"data t: val_fraction must be a number, got nan"):
        fg.ArrayData.split({"x": np.ones((10, 2))}, float("nan"), 0.2, seed=0, describe="t")


def test_train_refuses_data_that_is_not_a_dataset():
    with pytest.raises(FlowError, match="data= takes an fg.Dataset .* not a dict"):
        fg.train(fg.load(ROOT / "models" / "mlp.flow"), data={"x": 1}, steps=1, device="cpu", progress=False)


def test_an_error_in_data_from_python_does_not_point_at_the_files_data_line():
    few = fg.ArrayData.split({"x": np.ones((5, 64), np.float32), "y": np.arange(5) % 10}, 0.0, 0.0, seed=0,
                             describe="five rows")
    with pytest.raises(FlowError) as e:
        fg.train(fg.load(ROOT / "models" / "mlp.flow"), data=few, steps=1, device="cpu", progress=False)
    assert str(e.value).startswith("data five rows has 5 training rows, fewer than the model's batch size 64")
    assert e.value.span is None


def test_array_data_takes_y_as_the_target_whatever_the_dicts_order():
    rng = np.random.default_rng(0)
    x, y = rng.random((200, 64), dtype=np.float32), (np.arange(200) % 10).astype(np.int32)
    data = fg.ArrayData.split({"y": y, "x": x}, 0.1, 0.2, seed=0, describe="y first")
    assert data.roles == ("x", "y") and data.default_metric == "accuracy"
    res = fg.train(fg.load(ROOT / "models" / "mlp.flow"), data=data, steps=2, device="cpu", progress=False)
    assert "accuracy" in res.metrics


def test_set_params_takes_what_a_feed_takes():
    sess = fg.load(ROOT / "models" / "mlp.flow").compile(device="cpu")
    w = sess.params["w2"]
    with pytest.raises(FlowError, match=r"set_params: param 'w2' has dtype int32, but param w2 is f32\[128,10\]"):
        sess.set_params({"w2": w.astype(np.int32)})
    with pytest.raises(FlowError, match=r"set_params: param 'w2' has shape \[10, 128\], but param w2 is"):
        sess.set_params({"w2": w.T})
    sess.set_params({"w2": w.astype(np.float64) + 1})
    np.testing.assert_array_equal(sess.params["w2"], w + 1)


def test_apply_update_checks_its_gradients_then_updates():
    from flowgrad.training.optim import SGD

    sess = fg.load(ROOT / "models" / "mlp.flow").compile(device="cpu")
    grads = {k: np.ones_like(v) for k, v in sess.params.items()}
    with pytest.raises(FlowError, match="apply_update: no gradient for param 'b2'"):
        sess.apply_update(SGD(lr=0.5), {k: v for k, v in grads.items() if k != "b2"})
    with pytest.raises(FlowError, match="apply_update: mlp has no trainable param 'nope'"):
        sess.apply_update(SGD(lr=0.5), {**grads, "nope": 1.0})
    with pytest.raises(FlowError, match="optimizer must be a flowgrad optimizer"):
        sess.apply_update("sgd", grads)
    before = sess.params
    sess.apply_update(SGD(lr=0.5), grads)
    for k, v in sess.params.items():
        np.testing.assert_allclose(v, before[k] - 0.5, err_msg=k)


# -- 5. labels past i32, floats past f32 ----------------------------------------------

I32_RANGE = "outside the i32 range (-2147483648..2147483647)"
F32_RANGE = "outside the f32 range (largest 3.40282e+38): it would be inf"


@pytest.mark.parametrize("label, shown", [("4294967297", "4294967297"), ("1e20", "1e+20")])
def test_a_csv_label_past_i32_names_its_line_and_column(tmp_path, label, shown):
    """4294967297 trained as class 1 and 1e20 as class 0, wrapped when cast to i32."""
    write_rows(tmp_path, (6, 2, label))
    with pytest.raises(FlowError) as e:
        fg.train(fg.load(tiny(tmp_path)), device="cpu", progress=False)
    assert e.value.message == (f"data csv('rows.csv'): {tmp_path / 'rows.csv'}:8: column 'label' holds {shown}, "
                               f"{I32_RANGE}, as input y (i32[4]) takes it")


def test_an_npz_label_past_i32_names_its_row(tmp_path):
    y = np.arange(16, dtype=np.int64) % 3
    y[9] = 2**32 + 1
    np.savez(tmp_path / "d.npz", x=np.ones((16, 2)), y=y)
    with pytest.raises(FlowError) as e:
        fg.train(fg.load(tiny(tmp_path, 'npz("d.npz", val_fraction=0)')), device="cpu", progress=False)
    assert e.value.message == (f"data npz('d.npz'): {str(tmp_path / 'd.npz')!r}: array 'y' holds 4294967297 at row 9 "
                               f"(0-based), {I32_RANGE}, as input y (i32[4]) takes it")


def test_an_npz_value_past_f32_names_its_row_and_column(tmp_path):
    x = np.ones((16, 2))
    x[11, 1] = -1e39
    np.savez(tmp_path / "d.npz", feats=x, y=np.arange(16) % 3)
    with pytest.raises(FlowError) as e:
        fg.train(fg.load(tiny(tmp_path, 'npz("d.npz", x="feats", val_fraction=0)')), device="cpu", progress=False)
    assert e.value.message == (f"data npz(): {str(tmp_path / 'd.npz')!r}: array 'feats' holds -1e+39 at row 11, "
                               f"column 1 (0-based), {F32_RANGE}")


def test_a_csv_value_past_f32_names_its_line_and_column(tmp_path):
    write_rows(tmp_path, (3, 1, "1e39"))
    with pytest.raises(FlowError) as e:
        fg.train(fg.load(tiny(tmp_path)), device="cpu", progress=False)
    assert e.value.message == f"data csv(): {tmp_path / 'rows.csv'}:5: column 'b' holds '1e39', {F32_RANGE}"


def test_array_data_from_python_past_i32_or_f32_names_the_row():
    y = np.arange(40) % 3
    y[17] = -2**40
    data = fg.ArrayData.split({"x": np.ones((40, 2)), "y": y}, 0.0, 0.0, seed=0, describe="mine")
    model = fg.loads(TINY.split("train {")[0])
    with pytest.raises(FlowError, match=rf"data mine: y holds -1099511627776 at row 17 \(0-based\), "
                                        rf"{re.escape(I32_RANGE)}"):
        fg.train(model, data=data, steps=1, device="cpu", progress=False)
    x = np.ones((40, 2))
    x[3, 0] = 1e300
    data = fg.ArrayData.split({"x": x, "y": np.arange(40) % 3}, 0.0, 0.0, seed=0, describe="mine")
    with pytest.raises(FlowError, match=rf"data mine: x holds 1e\+300 at row 3, column 0 \(0-based\), "
                                        rf"{re.escape(F32_RANGE)}"):
        fg.train(model, data=data, steps=1, device="cpu", progress=False)


def test_a_feed_or_param_past_f32_is_refused_where_it_would_be_inf():
    sess = fg.load(ROOT / "models" / "mlp.flow").compile(device="cpu")
    w = sess.params["w2"].astype(np.float64)
    w[3, 4] = 1e39
    with pytest.raises(FlowError) as e:
        sess.set_params({"w2": w})
    assert e.value.message == f"set_params: param 'w2' holds 1e+39 at [3, 4], {F32_RANGE}"
    x = np.zeros((64, 64))
    x[0, 1] = -5e38
    with pytest.raises(FlowError, match=rf"feed 'x' holds -5e\+38 at \[0, 1\], {re.escape(F32_RANGE)}"):
        sess.step({"x": x, "y": np.zeros(64, np.int32)})
    x[0, 1] = np.inf   # an inf given as one is no number that overflows
    assert sess.step({"x": x, "y": np.zeros(64, np.int32)}, grads=False) is not None
    x[0, 1] = 7e4      # an f16 session's inputs are f16
    half = fg.load(ROOT / "models" / "mlp.flow").compile(device="cpu", dtype="f16")
    with pytest.raises(FlowError, match=r"feed 'x' holds 70000.0 at \[0, 1\], outside the f16 range \(largest 65504\)"):
        half.step({"x": x, "y": np.zeros(64, np.int32)})


def test_a_run_feed_file_past_f32_names_the_file_line_and_column(tmp_path, capsys):
    from flowgrad.training.arrayfiles import parse_feeds

    (tmp_path / "x.csv").write_text("a,b\n1,2\n3,1e39\n")
    with pytest.raises(FlowError) as e:
        parse_feeds([f"x={tmp_path / 'x.csv'}"])
    assert e.value.message == f"--feed x: {tmp_path / 'x.csv'}:3: column 'b' holds '1e39', {F32_RANGE}"
    x = np.zeros((4, 3))
    x[2, 1] = 2e39
    np.save(tmp_path / "x.npy", x)
    with pytest.raises(FlowError) as e:
        parse_feeds([f"x={tmp_path / 'x.npy'}"])
    assert e.value.message == f"--feed x: {str(tmp_path / 'x.npy')!r} holds 2e+39 at [2, 1], {F32_RANGE}"
