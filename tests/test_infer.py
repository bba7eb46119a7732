"""Inference at any batch size (sess.predict, `flowgrad run`), feeds and
outputs as files, the config read from the checkpoint, and `flowgrad
generate` on a character-level LM trained from a text file."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.cli import main as cli_main
from flowgrad.errors import FlowError
from flowgrad.training import checkpoint
from flowgrad.training.optim import SGD

MODELS = Path(__file__).resolve().parent.parent / "models"
TINY_GPT = {"d": 16, "layers": 1, "seq": 8, "batch": 4, "heads": 2}


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mlp")
    rc = cli_main(["train", str(MODELS / "mlp.flow"), "--device", "cpu", "--steps", "30", "--set", "hidden=16",
                   "--set", "batch=16", "--out", str(out)])
    assert rc == 0
    return out / "checkpoint.safetensors"


def digits_rows(n):
    from sklearn.datasets import load_digits

    return (load_digits().data[:n] / 16).astype(np.float32)


def reference_logits(ckpt_path, x):
    p = checkpoint.load(ckpt_path).params
    return np.maximum(x @ p["w1"] + p["b1"], 0) @ p["w2"] + p["b2"]


def test_predict_at_batch_sizes_1_7_and_the_training_batch_gives_the_same_rows(mlp_run):
    sess, _ = fg.load_trained(MODELS / "mlp.flow", mlp_run, device="cpu")   # the public name
    assert sess.graph.config["batch"] == 16 and sess.graph.config["hidden"] == 16  # from the checkpoint
    x = digits_rows(40)
    whole = sess.predict({"x": x})["logits"]   # 16 + 16 + 8: two sizes of session
    assert whole.shape == (40, 10) and "loss" not in sess.predict({"x": x[:1]})
    np.testing.assert_allclose(whole, reference_logits(mlp_run, x), rtol=1e-5, atol=1e-5)
    for n in (1, 7, 16):
        got = np.concatenate([sess.predict({"x": x[i:i + n]})["logits"] for i in range(0, 16, n)])[:16]
        np.testing.assert_allclose(got, whole[:16], rtol=1e-6, atol=1e-6)
    assert sorted(sess._predictor.sized) == [1, 7, 8]   # made once per size, kept
    y = np.zeros(7, np.int32)
    assert set(sess.predict({"x": x[:7], "y": y})) == {"logits", "loss"}


def test_tiny_gpt_predicts_at_batch_one_like_at_its_batch():
    sess = fg.load(MODELS / "tiny_gpt.flow", TINY_GPT).compile(device="cpu")
    toks = np.random.default_rng(0).integers(0, 16, (4, 8)).astype(np.int32)
    full = sess.predict({"tokens": toks})["logits"]
    for i in range(4):
        np.testing.assert_allclose(sess.predict({"tokens": toks[i:i + 1]})["logits"][0], full[i], rtol=1e-5,
                                   atol=1e-5)


def test_a_fixed_batch_is_a_clear_error():
    m = fg.loads("model fixed\ninput x: f32[4, 3]\nparam w: f32[3, 2] = zeros()\ny = x @ w\noutput y\n")
    sess = m.compile(device="cpu")
    assert sess.predict({"x": np.ones((4, 3))})["y"].shape == (4, 2)
    with pytest.raises(FlowError, match="runs only at batch size 4"):
        sess.predict({"x": np.ones((3, 3))})


def test_run_cli_csv_in_csv_out_with_the_checkpoint_config(mlp_run, tmp_path, capsys):
    x = digits_rows(5)
    (tmp_path / "x.csv").write_text(",".join(f"p{i}" for i in range(64)) + "\n"
                                    + "\n".join(",".join(f"{v:.6f}" for v in r) for r in x) + "\n")
    rc = cli_main(["run", str(MODELS / "mlp.flow"), "--checkpoint", str(mlp_run), "--device", "cpu",
                   "--feed", f"x={tmp_path / 'x.csv'}", "--out", str(tmp_path / "out.csv")])
    assert rc == 0, capsys.readouterr().err
    assert "wrote logits float32[5, 10]" in capsys.readouterr().out
    lines = (tmp_path / "out.csv").read_text().splitlines()
    assert lines[0] == ",".join(f"logits_{i}" for i in range(10)) and len(lines) == 6
    got = np.array([[float(v) for v in r.split(",")] for r in lines[1:]])
    np.testing.assert_allclose(got, reference_logits(mlp_run, x), rtol=1e-5, atol=1e-5)
    np.savez(tmp_path / "feeds.npz", x=x)
    rc = cli_main(["run", str(MODELS / "mlp.flow"), "--checkpoint", str(mlp_run), "--device", "cpu",
                   "--feed", str(tmp_path / "feeds.npz"), "--out", str(tmp_path / "out.npy")])
    assert rc == 0
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), got, rtol=1e-5, atol=1e-5)


def test_run_output_needs_only_the_inputs_that_output_reads(mlp_run, tmp_path, capsys):
    # an accuracy output reads the labels: asking for the logits alone must not need them
    src = (MODELS / "mlp.flow").read_text().replace("output logits", "acc = mean(cast(eq(argmax(logits), y), f32))\n"
                                                                      "output logits, acc")
    (tmp_path / "m.flow").write_text(src)
    x = digits_rows(20)
    np.save(tmp_path / "x.npy", x)
    args = ["run", str(tmp_path / "m.flow"), "--checkpoint", str(mlp_run), "--device", "cpu",
            "--feed", f"x={tmp_path / 'x.npy'}"]
    assert cli_main(args) == 1 and "missing feed for input y" in capsys.readouterr().err   # acc needs y
    assert cli_main(args + ["--output", "logits", "--out", str(tmp_path / "o.npy")]) == 0, capsys.readouterr().err
    np.testing.assert_allclose(np.load(tmp_path / "o.npy"), reference_logits(mlp_run, x), rtol=1e-5, atol=1e-5)
    assert cli_main(args + ["--output", "nope"]) == 1
    assert "--output nope: not an output of mlp (outputs: logits, acc, loss)" in capsys.readouterr().err
    sess, _ = fg.load_trained(tmp_path / "m.flow", mlp_run, device="cpu")
    assert set(sess.predict({"x": x}, outputs=["logits"])) == {"logits"}
    with pytest.raises(FlowError, match="missing feed for input y .*: output acc of mlp reads it") as err:
        sess.predict({"x": x})
    assert "outputs=[...]" in err.value.hint   # in Python the way out is naming the outputs, not a flag
    with pytest.raises(FlowError, match="'nope' is not an output of mlp"):
        sess.predict({"x": x}, outputs=["nope"])


def test_run_cli_set_overrides_the_checkpoint_config(mlp_run, tmp_path, capsys):
    np.save(tmp_path / "x.npy", digits_rows(3))
    rc = cli_main(["run", str(MODELS / "mlp.flow"), "--checkpoint", str(mlp_run), "--device", "cpu",
                   "--feed", f"x={tmp_path / 'x.npy'}", "--set", "hidden=32"])
    err = capsys.readouterr().err
    assert rc == 1 and "param w1: the model has shape [64, 32], the checkpoint [64, 16]" in err


CHAR_LM = {"d": 16, "heads": 2, "layers": 1, "seq": 16, "batch": 8}


def test_char_lm_trains_from_text_and_generate_samples_from_its_vocab(tmp_path, capsys):
    out = tmp_path / "lm"
    rc = cli_main(["train", str(MODELS / "char_lm.flow"), "--device", "cpu", "--steps", "60", "--out", str(out),
                   *[f"--set={k}={v}" for k, v in CHAR_LM.items()]])
    assert rc == 0
    text = capsys.readouterr().out
    assert "test perplexity" in text and "test loss" in text
    ckpt = checkpoint.load(out / "checkpoint.safetensors")
    vocab = ckpt.data["vocab"]
    source = (MODELS / "data" / "lincoln_dickens.txt").read_text()
    assert vocab == sorted(set(source)) and ckpt.data["level"] == "char"
    history = [r for r in map(__import__("json").loads, (out / "metrics.jsonl").read_text().splitlines()[1:])]
    losses = [r["loss"] for r in history]
    assert np.mean(losses[-5:]) < 0.85 * np.mean(losses[:5]), losses
    rc = cli_main(["generate", str(MODELS / "char_lm.flow"), "--checkpoint", str(out / "checkpoint.safetensors"),
                   "--device", "cpu", "--prompt", "It was", "--tokens", "30", "--top-k", "5"])
    assert rc == 0
    sample = capsys.readouterr().out.rstrip("\n")
    assert sample.startswith("It was") and len(sample) == len("It was") + 30
    assert set(sample) <= set(vocab)
    rc = cli_main(["generate", str(MODELS / "char_lm.flow"), "--checkpoint", str(out / "checkpoint.safetensors"),
                   "--device", "cpu", "--prompt", "It was", "--tokens", "5", "--temperature", "0"])
    greedy = capsys.readouterr().out
    from flowgrad.training.generate import generate
    from flowgrad.overrides import load_trained

    sess, _ = load_trained(MODELS / "char_lm.flow", out / "checkpoint.safetensors", device="cpu")
    assert generate(sess, vocab, "char", "It was", 5, temperature=0) + "\n" == greedy
    with pytest.raises(FlowError, match=r"'@' \(position 2\) is not in the model's vocabulary"):
        generate(sess, vocab, "char", "It@", 5)


def test_generate_refuses_a_model_that_is_not_causal(tmp_path):
    from flowgrad.training.generate import generate

    text = (MODELS / "tiny_gpt.flow").read_text().replace("causal=true", "causal=false")
    sess = fg.loads(text, TINY_GPT).compile(device="cpu")
    with pytest.raises(FlowError, match="is not causal"):
        generate(sess, [chr(97 + i) for i in range(16)], "char", "abc", 3)


def test_generate_samples_only_ids_of_the_vocabulary_when_the_model_is_sized_past_it():
    from flowgrad.training.generate import generate

    # tiny_gpt has vocab = 16; a text of 4 characters leaves ids 4..15 without a symbol, and an
    # untrained model gives them about the same probability as the rest
    sess = fg.load(MODELS / "tiny_gpt.flow", TINY_GPT).compile(device="cpu")
    for seed in range(3):
        sample = generate(sess, list("abcd"), "char", "abc", 20, seed=seed)
        assert len(sample) == 23 and set(sample) <= set("abcd")
    assert generate(sess, [97, 98, 99, 100], "byte", "abc", 20, seed=0).isascii()


def test_generate_samples_from_the_logits_when_a_softmax_output_is_declared_first():
    from flowgrad.training.generate import generate, lm_io

    text = (MODELS / "tiny_gpt.flow").read_text()
    plain = fg.loads(text, TINY_GPT).compile(device="cpu")
    probs_first = fg.loads(text.replace("output logits", "probs = softmax(logits)\noutput probs, logits"),
                           TINY_GPT).compile(device="cpu")
    assert lm_io(probs_first.graph)[1] == "logits"
    # peaked logits: read as logits, softmax's output (all in [0, 1]) samples almost uniformly
    params = {k: v * 200 if k == "w_out" else v for k, v in plain.params.items()}
    plain.set_params(params)
    probs_first.set_params(params)
    vocab = [chr(97 + i) for i in range(16)]
    assert generate(probs_first, vocab, "char", "abc", 30, seed=1) == generate(plain, vocab, "char", "abc", 30, seed=1)


def test_predict_names_the_feed_it_was_given_when_its_rank_is_wrong():
    sess = fg.load(MODELS / "mlp.flow", {"batch": 4, "hidden": 8}).compile(device="cpu")
    with pytest.raises(fg.FlowError, match=r"feed 'x' has shape \[64\], but input x is f32\[4,64\]"):
        sess.predict({"x": np.ones(64, np.float32)})


def test_a_bad_feed_csv_names_the_line(tmp_path):
    from flowgrad.training.arrayfiles import read_array

    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n\n3,oops\n")
    with pytest.raises(fg.FlowError, match=rf"--feed x: {path}:4: 'oops' is not a number"):
        read_array(str(path), "--feed x")
    path.write_text("a,b\n1,2\n3\n")
    with pytest.raises(fg.FlowError, match=rf"--feed x: {path}:3: 1 cells, where the first row has 2"):
        read_array(str(path), "--feed x")
    path.write_text("a,b\n1,2\n3,4.5\n")
    np.testing.assert_array_equal(read_array(str(path), "--feed x"), [[1, 2], [3, 4.5]])


def test_a_byte_level_prompt_names_the_character_a_missing_byte_belongs_to():
    from flowgrad.training.text import encode

    vocab = sorted(set("hello world".encode()))
    with pytest.raises(FlowError, match=r"byte 0xc3 of character 'ö' \(position 4\) is not in the model's vocabulary"):
        encode("hellö".encode(), vocab, "byte")


NOISY = """
config { batch = 4 }
input x: f32[batch, 3]
param w: f32[3] = ones()
n = x * w + randn_like(x)
loss = mean(n * w)
output n
minimize loss
"""


def test_predict_draws_fresh_noise_per_call_and_a_seed_reproduces():
    """predict gave the same randn_like samples on every call (a VAE's samples
    repeated): each call draws anew, as torch.randn_like does; seed= reproduces."""
    sess = fg.loads(NOISY).compile(device="cpu", seed=5)
    x = np.zeros((4, 3), np.float32)
    first, second = (sess.predict({"x": x})["n"] for _ in range(2))
    assert not np.array_equal(first, second)
    a, b = (sess.predict({"x": x}, seed=7)["n"] for _ in range(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, sess.predict({"x": x}, seed=8)["n"])
    # the session's own sequence reproduces too: a session seeded alike draws the same calls
    again = fg.loads(NOISY).compile(device="cpu", seed=5)
    np.testing.assert_array_equal(again.predict({"x": x})["n"], first)
    np.testing.assert_array_equal(again.predict({"x": x})["n"], second)
    # seed=k draws what the first predict of a session seeded k draws
    np.testing.assert_array_equal(fg.loads(NOISY).compile(device="cpu", seed=7).predict({"x": x})["n"], a)
    # and predict's noise is not a training step's
    assert not np.array_equal(first, sess.step({"x": x}).outputs["n"])
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(FlowError, match="seed must be an int"):
            sess.predict({"x": x}, seed=bad)


def test_predict_at_another_batch_size_draws_the_same_rows_noise():
    """The noise of a row does not depend on how many rows are predicted with it."""
    sess = fg.loads(NOISY).compile(device="cpu", seed=5)
    x = np.zeros((4, 3), np.float32)
    for _ in range(3):
        sess.step({"x": x}, optimizer=SGD(lr=0.1))
    want = sess.predict({"x": x}, seed=2)["n"]
    np.testing.assert_array_equal(sess.predict({"x": x[:2]}, seed=2)["n"], want[:2])
    np.testing.assert_array_equal(sess.predict({"x": np.zeros((6, 3), np.float32)}, seed=2)["n"][:4], want)


def test_load_trained_takes_a_seed(tmp_path):
    (tmp_path / "n.flow").write_text(NOISY)
    fg.load(tmp_path / "n.flow").compile(device="cpu").save_checkpoint(tmp_path / "ck.safetensors")
    x = {"x": np.zeros((4, 3), np.float32)}
    draws = [fg.load_trained(tmp_path / "n.flow", tmp_path / "ck.safetensors", device="cpu", seed=s)[0].predict(x)["n"]
             for s in (3, 3, 4)]
    np.testing.assert_array_equal(draws[0], draws[1])
    assert not np.array_equal(draws[0], draws[2])
    np.save(tmp_path / "x.npy", x["x"])
    rc = cli_main(["run", str(tmp_path / "n.flow"), "--checkpoint", str(tmp_path / "ck.safetensors"), "--device",
                   "cpu", "--seed", "3", "--feed", f"x={tmp_path / 'x.npy'}", "--output", "n",
                   "--out", str(tmp_path / "o.npy")])
    assert rc == 0
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), draws[0])


@pytest.mark.parametrize("device, backward", [("cpu", "auto"), ("vulkan", "graph"), ("vulkan", "closures")],
                         ids=lambda v: v)
def test_predict_in_chunks_draws_each_rows_own_noise(device, backward, request):
    """Each chunk of a predict larger than the batch restarted the noise's
    counter, so rows 4-7 drew rows 0-3's noise; every row must draw what one
    pass over all the rows gives it, the short last chunk's included."""
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    x = np.zeros((10, 3), np.float32)   # n is the noise itself; without the loss, chunks of 4, 4 and 2
    sess = fg.loads(NOISY).compile(device=device, backward=backward, seed=5)
    got = sess.predict({"x": x}, outputs=["n"], seed=5)["n"]
    assert sess.last_path.startswith("graph" if backward == "graph" else "closures")
    whole = fg.loads(NOISY.replace("batch = 4", "batch = 10")).compile(device="cpu", seed=5)
    want = whole.predict({"x": x}, seed=5)["n"]
    assert not np.array_equal(want[4:8], want[:4])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)   # the device's log and cos round otherwise
    # with no seed, the session's first predict draws alike
    np.testing.assert_allclose(sess.predict({"x": x}, outputs=["n"])["n"], want, rtol=1e-5, atol=1e-6)


def test_a_session_at_another_batch_size_is_compiled_as_the_session_was():
    """predict, and a step on fewer rows than the batch, run on the model
    built at their size: compiled with every option the session was given
    (fusion, backward, dtype, freeze, check_finite, the loss scaler), not
    with Model.compile's defaults."""
    from flowgrad.loss_scale import LossScaler

    mlp = fg.load("mlp", {"hidden": 8, "batch": 4})
    assert mlp.compile(device="cpu").plan.fusion.groups   # the default fuses its pointwise chains
    scaler = LossScaler(init_scale=8.0)
    sess = mlp.compile(device="cpu", dtype="mixed", backward="closures", fusion=False, freeze="w1",
                       check_finite=True, loss_scale=scaler)
    x = digits_rows(3)
    sess.predict({"x": x})
    sized = sess._predictor.sized[3]
    assert sized.plan.fusion.groups == []
    assert (sized.plan.dtype, sized.plan.backward, sized.check_finite) == ("mixed", "closures", True)
    assert sized.graph.frozen == {"w1"} and sized.loss_scaler is scaler
    before = sess.params
    sess.step({"x": x, "y": np.arange(3, dtype=np.int32)}, optimizer=SGD(lr=0.1))   # a short batch
    np.testing.assert_array_equal(sess.params["w1"], before["w1"])   # frozen: no update
    assert not np.array_equal(sess.params["w2"], before["w2"])
