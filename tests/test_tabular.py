"""Tabular preparation in csv() and npz(): missing values (na=), columns of
categories (categorical=, encode=), standardized features (standardize=),
what the training rows teach kept in the checkpoint and applied by
`flowgrad run`, and the listing of a file's bad cells."""
from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.cli import main as cli_main
from flowgrad.errors import FlowError
from flowgrad.training import checkpoint
from flowgrad.training.section import check_train, setup
from flowgrad.training.tabular import INF_HINT, NA_HINT, Table

WEATHER = ["clear", "cloudy", "rain", "snow"]

# x: temp and wind (standardized, filled); weather: the codes of its column, for an embedding
CODES = """
model days
config {
  batch = 8
}
input x: f32[batch, 2]
input weather: i32[batch]
input y: i32[batch]
param emb: f32[4, 3] = normal(std=0.3)
param w: f32[5, 3] = xavier()
logits = concat(x, embedding(weather, emb)) @ w
loss = cross_entropy(logits, y)
output logits
minimize loss
train {
  data = DATA
  optimizer = adam(lr=0.05)
  steps = 6
}
"""

# x: temp, wind and weather's four one-hot columns
ONEHOT = """
model days
config {
  batch = 8
}
input x: f32[batch, 6]
input y: i32[batch]
param w: f32[6, 3] = xavier()
logits = x @ w
loss = cross_entropy(logits, y)
output logits
minimize loss
train {
  data = DATA
  steps = 4
}
"""


def days(n=60, missing=(), cells=None):
    """n rows of temp, wind, weather, demand (low/mid/high); `missing` lists
    (row, column) cells left empty, `cells` maps (row, column) to a text."""
    rng = np.random.default_rng(7)
    rows = []
    for i in range(n):
        temp, wind, weather = rng.normal(15, 8), rng.uniform(0, 40), WEATHER[i % 4]
        score = temp / 8 - wind / 20 - WEATHER.index(weather) / 2
        rows.append([f"{temp:.1f}", f"{wind:.0f}", weather, "low" if score < -1 else "mid" if score < 1 else "high"])
    for (r, c), text in {**{cell: "" for cell in missing}, **(cells or {})}.items():
        rows[r][["temp", "wind", "weather", "demand"].index(c)] = text
    return "temp,wind,weather,demand\n" + "".join(",".join(r) + "\n" for r in rows)


def load(tmp_path, args, text=CODES, rows=None):
    (tmp_path / "days.csv").write_text(rows if rows is not None else days())
    (tmp_path / "m.flow").write_text(text.replace("DATA", f'csv("days.csv", y="demand", {args})'))
    return fg.load(tmp_path / "m.flow")


def data_of(tmp_path, args, text=CODES, rows=None):
    return setup(load(tmp_path, args, text, rows).graph).data


def column(values, name):
    """A column of the CSV text as floats (missing: nan) or strings."""
    lines = [line.split(",") for line in values.splitlines()]
    j = lines[0].index(name)
    cells = [r[j] for r in lines[1:]]
    try:
        return np.array([float(c) if c else np.nan for c in cells])
    except ValueError:
        return np.array(cells, object)


# -- na= ----------------------------------------------------------------------------------

def test_na_error_lists_every_missing_cell_with_the_options_that_fix_it(tmp_path):
    rows = days(missing=[(2, "temp"), (5, "wind"), (9, "weather")])
    with pytest.raises(FlowError) as e:
        data_of(tmp_path, 'categorical=["weather"]', rows=rows)
    file = tmp_path / "days.csv"
    assert e.value.message == (f"data csv(): 3 bad cells:\n  {file}:4: column 'temp' holds '', a missing value\n"
                               f"  {file}:7: column 'wind' holds '', a missing value\n"
                               f"  {file}:11: column 'weather' holds '', a missing value")
    assert e.value.hint == NA_HINT and e.value.span.line == 16


def test_na_drop_leaves_out_the_rows_with_a_missing_value(tmp_path):
    rows = days(missing=[(2, "temp"), (5, "wind"), (9, "weather"), (11, "demand")])
    data = data_of(tmp_path, 'categorical=["weather"], na="drop"', rows=rows)
    assert sum(data.size(s) for s in ("train", "val", "test")) == 56
    kept = sorted(data.lines[np.concatenate([data.origin[s] for s in ("train", "val", "test")])])
    assert [line for line in range(2, 62) if line not in kept] == [4, 7, 11, 13]   # the file's lines


@pytest.mark.parametrize("na", ["mean", "median", 21.5])
def test_na_fills_a_missing_number_with_the_training_rows_statistic(tmp_path, na):
    rows = days(missing=[(r, "temp") for r in (2, 3, 17, 40)])
    data = data_of(tmp_path, f'categorical=["weather"], na={json.dumps(na)}', rows=rows)
    temp = column(rows, "temp")
    train = temp[data.origin["train"]]
    want = (np.nanmean(train) if na == "mean" else np.nanmedian(train) if na == "median" else na)
    assert data.meta()["prep"]["columns"][0] == {"name": "temp", "fill": pytest.approx(want, rel=1e-12), "mean": 0.0,
                                                 "scale": 1.0}
    for split in ("train", "val", "test"):   # every split's missing cells take the training rows' value
        got = data.parts[split]["x"][:, 0]
        missing = np.isnan(temp[data.origin[split]])
        np.testing.assert_allclose(got, np.where(missing, want, temp[data.origin[split]]), rtol=1e-6)
    assert sum(np.isnan(temp[data.origin[s]]).sum() for s in ("train", "val", "test")) == 4


def test_na_fills_a_missing_category_with_the_most_frequent_and_never_a_target(tmp_path):
    rows = days(missing=[(1, "weather")], cells={(i, "weather"): "rain" for i in (0, 4, 8, 12)})
    data = data_of(tmp_path, 'categorical=["weather"], na="mean"', rows=rows)
    column_ = data.meta()["prep"]["columns"][2]
    assert column_["categories"] == WEATHER and column_["fill"] == "rain"
    split = next(s for s in ("train", "val", "test") if 1 in data.origin[s])   # the row whose weather is missing
    assert data.parts[split]["weather"][list(data.origin[split]).index(1)] == WEATHER.index("rain")
    with pytest.raises(FlowError) as e:
        data_of(tmp_path, 'categorical=["weather"], na="mean"', rows=days(missing=[(4, "demand")]))
    assert e.value.message.endswith("days.csv:6: column 'demand' holds '', a missing value")
    assert e.value.hint == 'a missing target is never filled: na="drop" drops its row'


@pytest.mark.parametrize("na, message", [
    ('"zero"', "na must be one of 'error', 'drop', 'mean', 'median' or a number, got \"zero\""),
    ("true", "na must be one of 'error', 'drop', 'mean', 'median' or a number, got true"),
    ("1e39", "na=1e+39 is outside the f32 range"),
])
def test_a_bad_na_is_an_error(tmp_path, na, message):
    with pytest.raises(FlowError, match=re.escape(message)):
        data_of(tmp_path, f'categorical=["weather"], na={na}')


# -- categorical= -------------------------------------------------------------------------

def test_categorical_codes_feed_the_input_named_as_the_column_and_train(tmp_path):
    rows = days()
    model = load(tmp_path, 'categorical=["weather"]', rows=rows)
    data = setup(model.graph).data
    assert data.inputs == {"x": "x", "weather": "weather", "y": "y"}
    weather = column(rows, "weather")
    for split in ("train", "val", "test"):
        codes = data.parts[split]["weather"]
        assert codes.dtype == np.int32
        assert [WEATHER[c] for c in codes] == list(weather[data.origin[split]])
        np.testing.assert_allclose(data.parts[split]["x"], np.stack([column(rows, "temp"), column(rows, "wind")],
                                                                    axis=1)[data.origin[split]], rtol=1e-6)
    res = fg.train(model, device="cpu", progress=False)
    assert res.steps == 6 and res.metric == "accuracy"


def test_categorical_onehot_joins_x_in_the_columns_place(tmp_path):
    rows = days()
    data = data_of(tmp_path, 'x=["temp", "weather", "wind"], categorical=["weather"], encode="onehot"', ONEHOT,
                   rows)
    assert data.columns["x"] == ["temp", "weather=clear", "weather=cloudy", "weather=rain", "weather=snow", "wind"]
    x, rows_ = data.parts["train"]["x"], data.origin["train"]
    weather = column(rows, "weather")[rows_]
    np.testing.assert_array_equal(x[:, 1:5], [[w == c for c in WEATHER] for w in weather])
    np.testing.assert_allclose(x[:, 5], column(rows, "wind")[rows_])
    assert "weather" not in data.inputs


def test_a_categorical_column_without_its_input_is_an_error(tmp_path):
    with pytest.raises(FlowError) as e:
        data_of(tmp_path, 'x=["temp", "wind"], categorical=["weather"]', ONEHOT.replace("6", "2"))
    assert "the codes of categorical column 'weather' feed an input weather, and days has none" in str(e.value)
    assert "embedding(weather, ...)" in e.value.hint and 'encode="onehot"' in e.value.hint


def test_an_embedding_too_small_for_the_categories_names_the_column(tmp_path):
    with pytest.raises(FlowError) as e:
        data_of(tmp_path, 'categorical=["weather"]', CODES.replace("f32[4, 3]", "f32[3, 3]"))
    assert "weather holds 3, but embedding at" in str(e.value)
    assert e.value.hint == "column 'weather' has 4 categories: what reads weather needs as many rows"


@pytest.mark.parametrize("args, message", [
    ('categorical=["demand"]', "column 'demand' is the target; categorical=[...] names feature columns"),
    ('categorical=["wether"]', "no column 'wether'"),
    ('categorical=["weather"], encode="dense"', "unknown encode 'dense' (one of: codes, onehot)"),
    ('x=["weather"], categorical=["weather"]', "no columns left for x"),
])
def test_categorical_errors(tmp_path, args, message):
    with pytest.raises(FlowError, match=re.escape(message)):
        data_of(tmp_path, args)


def test_a_category_only_outside_the_training_rows_is_an_error_naming_it(tmp_path):
    data = data_of(tmp_path, 'categorical=["weather"]')
    row = int(data.origin["test"][0])
    with pytest.raises(FlowError) as e:
        data_of(tmp_path, 'categorical=["weather"]', rows=days(cells={(row, "weather"): "fog"}))
    assert e.value.message.endswith(f"days.csv:{row + 2}: column 'weather' holds 'fog', a category the training "
                                    "rows never had (they had 'clear', 'cloudy', 'rain', 'snow')")
    assert "the split put every row of it outside the training rows" in e.value.hint


# -- standardize= -------------------------------------------------------------------------

def test_standardize_takes_the_training_rows_mean_and_scale_to_every_split(tmp_path):
    rows = days()
    data = data_of(tmp_path, 'categorical=["weather"], standardize=true', rows=rows)
    raw = np.stack([column(rows, "temp"), column(rows, "wind")], axis=1)
    train = raw[data.origin["train"]]
    mean, scale = train.mean(axis=0), train.std(axis=0)
    prep = data.meta()["prep"]["columns"]
    np.testing.assert_allclose([prep[0]["mean"], prep[1]["mean"]], mean)
    np.testing.assert_allclose([prep[0]["scale"], prep[1]["scale"]], scale)
    np.testing.assert_allclose(data.parts["train"]["x"].mean(axis=0), 0, atol=1e-6)
    np.testing.assert_allclose(data.parts["train"]["x"].std(axis=0), 1, atol=1e-5)
    np.testing.assert_allclose(data.parts["test"]["x"], (raw[data.origin["test"]] - mean) / scale, rtol=1e-5,
                               atol=1e-6)


def test_standardize_leaves_a_constant_column_at_zero(tmp_path):
    rows = days().replace(",", ";").splitlines()
    text = "\n".join(rows[:1] + [";".join(r.split(";")[:1] + ["5"] + r.split(";")[2:]) for r in rows[1:]])
    data = data_of(tmp_path, 'categorical=["weather"], standardize=true, delimiter=";"', rows=text)
    assert data.meta()["prep"]["columns"][1]["scale"] == 1.0
    np.testing.assert_array_equal(data.parts["train"]["x"][:, 1], 0)


# -- the bad-cell listing -----------------------------------------------------------------

def test_a_file_with_many_bad_cells_lists_the_first_ten_and_counts_them_all(tmp_path):
    cells = {(r, "wind"): "calm" for r in range(3, 15)} | {(20, "temp"): "inf", (30, "temp"): "4e38"}
    with pytest.raises(FlowError) as e:
        data_of(tmp_path, 'categorical=["weather"]', rows=days(missing=[(1, "temp")], cells=cells))
    file = tmp_path / "days.csv"
    lines = e.value.message.splitlines()
    assert lines[0] == "data csv(): 15 bad cells (the first 10 listed):"
    assert lines[1] == f"  {file}:3: column 'temp' holds '', a missing value"
    assert lines[2:11] == [f"  {file}:{r + 2}: column 'wind' holds 'calm', not a number" for r in range(3, 12)]
    assert lines[11:] == ["  and 5 more"]
    # the hints fix every bad cell, those past the first ten too
    assert e.value.hint == "; ".join([NA_HINT, "categorical=[\"wind\"] reads column 'wind' as categories", INF_HINT])
    # `flowgrad check` reports the same error
    model = load(tmp_path, 'categorical=["weather"]', rows=days(cells=cells))
    assert [err.message for err in check_train(model.graph)][0].startswith("data csv(): 14 bad cells")


def test_an_npz_lists_its_bad_values_and_takes_na_and_standardize(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.normal(3, 2, (40, 2))
    x[[4, 9, 13], 1] = np.nan
    x[20, 0] = np.inf
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(40) % 3)
    (tmp_path / "m.flow").write_text(ONEHOT.replace("6", "2").replace("DATA", 'npz("d.npz")'))
    with pytest.raises(FlowError) as e:
        setup(fg.load(tmp_path / "m.flow").graph)
    at = f"data npz(): 4 bad cells:\n  {str(tmp_path / 'd.npz')!r}: array 'x' holds"
    assert e.value.message == (f"{at.split(chr(10))[0]}\n" + "\n".join(
        f"  {str(tmp_path / 'd.npz')!r}: array 'x' holds {v} at row {r}, column {c} (0-based), {why}"
        for r, c, v, why in [(4, 1, "nan", "a missing value"), (9, 1, "nan", "a missing value"),
                             (13, 1, "nan", "a missing value"), (20, 0, "inf", "not a finite number")]))
    x[20, 0] = 1.0
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(40) % 3)
    (tmp_path / "m.flow").write_text(ONEHOT.replace("6", "2").replace("DATA", 'npz("d.npz", na="median", '
                                                                               'standardize=true)'))
    data = setup(fg.load(tmp_path / "m.flow").graph).data
    train = x[data.origin["train"]]
    fill = np.nanmedian(train, axis=0)
    filled = np.where(np.isnan(train), fill, train)
    prep = data.meta()["prep"]
    np.testing.assert_allclose(prep["fill"], fill)
    np.testing.assert_allclose(prep["mean"], filled.mean(axis=0))
    np.testing.assert_allclose(prep["scale"], filled.std(axis=0))
    test = x[data.origin["test"]]
    np.testing.assert_allclose(data.parts["test"]["x"], (np.where(np.isnan(test), fill, test) - prep["mean"])
                               / prep["scale"], rtol=1e-5, atol=1e-6)
    (tmp_path / "m.flow").write_text(ONEHOT.replace("6", "2").replace("DATA", 'npz("d.npz", na="drop")'))
    data = setup(fg.load(tmp_path / "m.flow").graph).data
    kept = np.concatenate([data.origin[s] for s in ("train", "val", "test")])
    assert sorted(set(range(40)) - set(kept)) == [4, 9, 13]


# -- the checkpoint and `flowgrad run` ----------------------------------------------------

def run_rows(rows: str) -> str:
    """The CSV's rows less the target column."""
    return "\n".join(",".join(r.split(",")[:3]) for r in rows.splitlines()) + "\n"


def test_run_prepares_rows_as_training_did_from_the_checkpoint(tmp_path, capsys):
    rows = days(missing=[(2, "temp"), (8, "wind")])
    model = load(tmp_path, 'categorical=["weather"], na="median", standardize=true', rows=rows)
    res = fg.train(model, device="cpu", progress=False, out=tmp_path / "run")
    ckpt = checkpoint.load(tmp_path / "run" / "checkpoint.safetensors")
    prep = ckpt.data["prep"]
    assert prep == json.loads(json.dumps(setup(model.graph).data.meta()["prep"]))   # the round trip
    assert Table.from_meta(prep).meta() | {"inputs": prep["inputs"]} == prep
    assert prep["inputs"] == {"x": "x", "weather": "weather"}
    new = "temp,wind,weather\n20.5,,rain\n,12,clear\n-3,30,snow\n"
    (tmp_path / "new.csv").write_text(new)
    rc = cli_main(["run", str(tmp_path / "m.flow"), "--checkpoint", str(tmp_path / "run" / "checkpoint.safetensors"),
                   "--device", "cpu", "--feed", f"x={tmp_path / 'new.csv'}", "--out", str(tmp_path / "out.npy")])
    assert rc == 0, capsys.readouterr().err
    temp, wind = (prep["columns"][i] for i in (0, 1))
    x = np.array([[20.5, wind["fill"]], [temp["fill"], 12], [-3, 30]])
    x = (x - [temp["mean"], wind["mean"]]) / [temp["scale"], wind["scale"]]
    want = res.session.predict({"x": x.astype(np.float32), "weather": np.array([2, 0, 3], np.int32)})["logits"]
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), want, rtol=1e-5, atol=1e-6)
    # the training file itself, target column and all, runs too: the target is left unread
    rc = cli_main(["run", str(tmp_path / "m.flow"), "--checkpoint", str(tmp_path / "run" / "checkpoint.safetensors"),
                   "--device", "cpu", "--feed", f"x={tmp_path / 'days.csv'}", "--out", str(tmp_path / "all.npy")])
    assert rc == 0 and np.load(tmp_path / "all.npy").shape == (60, 3)


def test_run_names_an_unseen_category_and_every_other_bad_cell(tmp_path, capsys):
    model = load(tmp_path, 'categorical=["weather"], standardize=true')
    fg.train(model, device="cpu", progress=False, out=tmp_path / "run")
    (tmp_path / "new.csv").write_text("wind,weather,temp\n3,fog,1\n,rain,2\n4,rain,x\n")
    rc = cli_main(["run", str(tmp_path / "m.flow"), "--checkpoint", str(tmp_path / "run" / "checkpoint.safetensors"),
                   "--device", "cpu", "--feed", f"x={tmp_path / 'new.csv'}"])
    err = capsys.readouterr().err
    file = tmp_path / "new.csv"
    assert rc == 1 and err.splitlines()[:4] == [
        "error: --feed x: 3 bad cells:",
        f"  {file}:2: column 'weather' holds 'fog', a category the training rows never had (they had 'clear', "
        "'cloudy', 'rain', 'snow')",
        f"  {file}:3: column 'wind' holds '', a missing value",
        f"  {file}:4: column 'temp' holds 'x', not a number"]
    assert 'training filled no missing value (na="error")' in err
    (tmp_path / "new.csv").write_text("temp,weather\n3,rain\n")
    assert cli_main(["run", str(tmp_path / "m.flow"), "--checkpoint", str(tmp_path / "run" / "checkpoint.safetensors"),
                     "--device", "cpu", "--feed", f"x={tmp_path / 'new.csv'}"]) == 1
    assert "new.csv' has no column 'wind' (its columns: temp, weather)" in capsys.readouterr().err
    np.save(tmp_path / "x.npy", np.zeros((2, 2)))
    assert cli_main(["run", str(tmp_path / "m.flow"), "--checkpoint", str(tmp_path / "run" / "checkpoint.safetensors"),
                     "--device", "cpu", "--feed", f"x={tmp_path / 'x.npy'}"]) == 1
    err = capsys.readouterr().err
    assert "--feed x: the model was trained on csv('days.csv'), which prepares x from the file's columns" in err


def test_run_standardizes_an_npz_trained_models_feed(tmp_path, capsys):
    rng = np.random.default_rng(5)
    x = rng.normal(100, 30, (48, 2))
    np.savez(tmp_path / "d.npz", x=x, y=(x[:, 0] > 100).astype(np.int64))
    (tmp_path / "m.flow").write_text(ONEHOT.replace("6", "2").replace("DATA", 'npz("d.npz", standardize=true)'))
    res = fg.train(fg.load(tmp_path / "m.flow"), device="cpu", progress=False, out=tmp_path / "run")
    prep = checkpoint.load(tmp_path / "run" / "checkpoint.safetensors").data["prep"]
    np.save(tmp_path / "x.npy", x[:5])
    rc = cli_main(["run", str(tmp_path / "m.flow"), "--checkpoint", str(tmp_path / "run" / "checkpoint.safetensors"),
                   "--device", "cpu", "--feed", f"x={tmp_path / 'x.npy'}", "--out", str(tmp_path / "out.npy")])
    assert rc == 0, capsys.readouterr().err
    want = res.session.predict({"x": ((x[:5] - prep["mean"]) / prep["scale"]).astype(np.float32)})["logits"]
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), want, rtol=1e-5, atol=1e-6)


def test_resume_refuses_data_prepared_otherwise(tmp_path):
    rows = days()
    fg.train(load(tmp_path, 'categorical=["weather"], standardize=true', rows=rows), device="cpu", progress=False,
             out=tmp_path / "run")
    edited = rows.replace("\n", "\n40.0,1,clear,high\n", 1)   # one more row: other means and scales
    with pytest.raises(FlowError) as e:
        fg.train(load(tmp_path, 'categorical=["weather"], standardize=true', rows=edited), device="cpu",
                 progress=False, out=tmp_path / "run", resume=True, steps=8)
    assert "the data's preparation changed since it was written (columns 'temp', 'wind')" in str(e.value)
    with pytest.raises(FlowError) as e:
        fg.train(load(tmp_path, 'categorical=["weather"]', rows=rows), device="cpu", progress=False,
                 out=tmp_path / "run", resume=True, steps=8)
    assert "(standardize True -> False, columns 'temp', 'wind')" in str(e.value)
    two = ONEHOT.replace("6", "2")   # temp and wind alone: trained first as they are, then standardized
    fg.train(load(tmp_path, 'x=["temp", "wind"]', two, rows), device="cpu", progress=False, out=tmp_path / "raw")
    with pytest.raises(FlowError) as e:
        fg.train(load(tmp_path, 'x=["temp", "wind"], standardize=true', two, rows), device="cpu", progress=False,
                 out=tmp_path / "raw", resume=True, steps=8)
    assert ("the data's preparation changed since it was written (no na=, categorical= or standardize= -> "
            "na='error', standardize=True)") in str(e.value)


# -- the shipped example ------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def test_the_bike_days_file_is_what_its_script_makes():
    script = runpy.run_path(str(ROOT / "scripts" / "make_bike_days.py"))
    assert (ROOT / "models" / "data" / "bike_days.csv").read_text() == script["rows"]()


def test_the_tabular_example_trains_and_runs_on_rows_with_the_files_columns(tmp_path, capsys):
    model = ROOT / "models" / "tabular.flow"
    assert cli_main(["train", str(model), "--device", "cpu", "--steps", "20", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "test accuracy" in out
    ckpt = tmp_path / "run" / "checkpoint.safetensors"
    prep = checkpoint.load(ckpt).data["prep"]
    assert [c["name"] for c in prep["columns"]] == ["temp", "humidity", "wind", "holiday", "weather"]
    assert prep["na"] == "median" and prep["standardize"] and prep["inputs"] == {"x": "x", "weather": "weather"}
    (tmp_path / "days.csv").write_text("temp,humidity,wind,holiday,weather\n24.0,45,6,0,clear\n,92,20,0,rain\n"
                                       "-4.5,70,15,1,snow\n")
    assert cli_main(["run", str(model), "--checkpoint", str(ckpt), "--device", "cpu", "--feed",
                     f"x={tmp_path / 'days.csv'}", "--out", str(tmp_path / "pred.npy")]) == 0
    cols = prep["columns"]
    raw = np.array([[24.0, 45, 6, 0], [cols[0]["fill"], 92, 20, 0], [-4.5, 70, 15, 1]])
    x = (raw - [c["mean"] for c in cols[:4]]) / [c["scale"] for c in cols[:4]]
    sess, _ = fg.load_trained(model, ckpt, device="cpu")
    want = sess.predict({"x": x.astype(np.float32), "weather": np.array([0, 2, 3], np.int32)})["logits"]
    np.testing.assert_allclose(np.load(tmp_path / "pred.npy"), want, rtol=1e-5, atol=1e-6)


def test_a_file_without_a_header_runs_by_position_with_or_without_its_target(tmp_path, capsys):
    rows = days().split("\n", 1)[1]   # no header: columns 0..3, the target 3
    (tmp_path / "days.csv").write_text(rows)
    (tmp_path / "m.flow").write_text(ONEHOT.replace("DATA", 'csv("days.csv", y=3, header=false, categorical=[2], '
                                                            'encode="onehot", standardize=true)'))
    res = fg.train(fg.load(tmp_path / "m.flow"), device="cpu", progress=False, out=tmp_path / "run")
    ckpt = str(tmp_path / "run" / "checkpoint.safetensors")
    first = rows.splitlines()[:3]
    (tmp_path / "all.csv").write_text("\n".join(first) + "\n")
    (tmp_path / "less.csv").write_text("\n".join(r.rsplit(",", 1)[0] for r in first) + "\n")
    got = []
    for name in ("all.csv", "less.csv"):
        assert cli_main(["run", str(tmp_path / "m.flow"), "--checkpoint", ckpt, "--device", "cpu", "--feed",
                         f"x={tmp_path / name}", "--out", str(tmp_path / "out.npy")]) == 0, capsys.readouterr().err
        got.append(np.load(tmp_path / "out.npy"))
    data = setup(fg.load(tmp_path / "m.flow").graph).data
    x = np.concatenate([data.parts[s]["x"][list(data.origin[s]).index(i)][None] for i in range(3)
                        for s in ("train", "val", "test") if i in data.origin[s]])
    want = res.session.predict({"x": x})["logits"]
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], want, rtol=1e-5, atol=1e-6)
    (tmp_path / "short.csv").write_text("1,2\n")
    assert cli_main(["run", str(tmp_path / "m.flow"), "--checkpoint", ckpt, "--device", "cpu", "--feed",
                     f"x={tmp_path / 'short.csv'}"]) == 1
    assert "has 2 columns; the training file had 4 (3 without the target)" in capsys.readouterr().err


def test_npz_drop_leaves_out_rows_of_a_fixed_test_set_too(tmp_path):
    rng = np.random.default_rng(4)
    x, xt = rng.normal(size=(30, 2)), rng.normal(size=(10, 2))
    x[3, 0] = xt[7, 1] = np.nan
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(30) % 3, xt=xt, yt=np.arange(10) % 3)
    (tmp_path / "m.flow").write_text(ONEHOT.replace("6", "2").replace(
        "DATA", 'npz("d.npz", x_test="xt", y_test="yt", na="drop")'))
    data = setup(fg.load(tmp_path / "m.flow").graph).data
    assert sorted(data.origin["test"]) == [0, 1, 2, 3, 4, 5, 6, 8, 9]
    assert 3 not in np.concatenate([data.origin["train"], data.origin["val"]])
    np.testing.assert_array_equal(data.parts["test"]["x"], xt[[0, 1, 2, 3, 4, 5, 6, 8, 9]].astype(np.float32))
