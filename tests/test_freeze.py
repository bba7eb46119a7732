"""Frozen params (compile(freeze=...), the train section's `freeze`): no
gradient, no update, no weight decay, no optimizer state, on numpy and on
the Vulkan graph path; the backward skips what only they reach; the others
train as they would unfrozen (and as PyTorch trains them with
requires_grad=False); checkpoints keep them."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError
from flowgrad.training.optim import AdamW
from conftest import needs_module

SMALL = {"vocab": 16, "seq": 8, "d": 16, "heads": 2, "layers": 2, "ff": 32, "batch": 4}
FROZEN = ["tok_emb", "decoder.0"]


def gpt(**config):
    return fg.load("tiny_gpt", config={**SMALL, **config})


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, 16, (4, 8)).astype(np.int32),
             "targets": rng.integers(0, 16, (4, 8)).astype(np.int32)} for _ in range(n)]


def frozen_names(graph):
    return [n for n in graph.params if n == "tok_emb" or n.startswith("decoder.0.")]


def train(sess, steps=3, opt=None):
    opt = opt or AdamW(lr=1e-2, weight_decay=0.1)   # decay would move a frozen param, were it updated
    for feeds in batches(steps):
        sess.step(feeds, optimizer=opt)
    return sess.params


def test_frozen_params_stay_bit_identical_and_the_others_train_on_numpy():
    sess = gpt().compile(device="cpu", freeze=FROZEN)
    start = sess.params
    names = frozen_names(sess.graph)
    assert sorted(sess.graph.frozen) == sorted(names) and len(names) == 11
    res = sess.step(batches(1)[0])
    assert not set(res.grads) & set(names)   # no gradient reported (nor computed: below)
    after = train(sess)
    for name in sess.graph.params:
        same = np.array_equal(after[name], start[name])
        assert same == (name in names), name
    assert not set(sess.runner.opt_state) & set(names)   # no optimizer state for them


def test_one_step_moves_the_other_params_exactly_as_without_freezing():
    frozen = gpt().compile(device="cpu", freeze=FROZEN)
    plain = gpt().compile(device="cpu")
    a, b = train(frozen, steps=1), train(plain, steps=1)
    for name in frozen.graph.trainable():
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_the_backward_skips_what_only_frozen_params_reach():
    sess = gpt(layers=1).compile(device="cpu", freeze=["tok_emb", "pos_emb"])
    g = sess.graph
    embedding = next(n.id for n in g.nodes if n.op == "embedding")
    first_add = next(n.id for n in g.nodes if n.op == "add" and embedding in n.inputs)
    plain = gpt(layers=1).compile(device="cpu").plan.grad_nodes
    assert embedding in plain and first_add in plain
    assert embedding not in sess.plan.grad_nodes and first_add not in sess.plan.grad_nodes
    # the closures' backward differentiates that set only
    step, nodes, _last = sess.runner.executor.step_graph(g.loss)
    differentiated = {n.grad_of for n in nodes}
    assert g.loss in differentiated and not {embedding, first_add} & differentiated
    report = sess.explain().to_dict()
    assert report["frozen"] == ["tok_emb", "pos_emb"]
    verdicts = {n["name"]: n["verdict"] for n in report["nodes"] if n["op"] == "param"}
    assert verdicts["tok_emb"] == verdicts["pos_emb"] == "frozen" and verdicts["lnf_g"] == "param"
    assert "frozen: tok_emb, pos_emb (no gradient, no update)" in sess.explain().text()


def test_frozen_params_on_the_vulkan_graph_path(vk_device):
    feeds = batches(3)
    sess = gpt().compile(device="vulkan", backward="graph", freeze=FROZEN)
    cpu = gpt().compile(device="cpu", freeze=FROZEN)
    start = sess.params
    after, want = train(sess), train(cpu)
    assert sess.last_path == "graph"
    names = frozen_names(sess.graph)
    for name in sess.graph.params:
        if name in names:
            np.testing.assert_array_equal(after[name], start[name], err_msg=name)
        else:
            assert not np.array_equal(after[name], start[name]), name
            np.testing.assert_allclose(after[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
    # no gradient is computed or read back for them, and the update has no state for them
    prog = next(iter(sess.runner.programs.values()))
    assert not any(key.startswith(f"@grad:{n}") for n in names for key, *_ in prog.layout.io.downloads)
    _counts, state = sess.runner.get_opt_state()
    assert not set(state) & set(names)
    embedding = next(n.id for n in sess.graph.nodes if n.op == "embedding")
    assert embedding not in sess.plan.grad_nodes
    res = sess.step(feeds[0])
    assert not set(res.grads) & set(names)


def test_frozen_params_match_pytorch_requires_grad_false():
    torch = needs_module("torch")
    from flowgrad.torch_twin import TorchTwin

    sess = gpt(layers=1).compile(device="cpu", freeze=["tok_emb", "decoder.0.w*"])
    twin = TorchTwin(sess.graph, {k: v.astype(np.float64) for k, v in sess.params.items()})
    trained = [p for p in twin.params.values() if p.requires_grad]
    assert len(trained) == len(sess.graph.trainable()) < len(sess.graph.params)
    opt = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.1)
    ours = AdamW(lr=1e-2, weight_decay=0.1)
    for feeds in batches(3):
        sess.step(feeds, optimizer=ours)
        opt.zero_grad()
        twin.step(twin.feeds(feeds))
        opt.step()
    got = sess.params
    for name, p in twin.params.items():
        np.testing.assert_allclose(got[name], p.detach().numpy(), rtol=2e-4, atol=2e-5, err_msg=name)


def test_checkpoints_save_and_load_frozen_params(tmp_path):
    sess = gpt().compile(device="cpu", freeze=FROZEN)
    train(sess, steps=1)
    sess.save_checkpoint(tmp_path / "c.safetensors")
    other = gpt().compile(device="cpu", seed=7, freeze=FROZEN)
    other.load_checkpoint(tmp_path / "c.safetensors")
    for name, value in sess.params.items():
        np.testing.assert_array_equal(other.params[name], value, err_msg=name)


def test_fine_tuning_with_a_frozen_embedding(tmp_path):
    # pretrain everything, then fine-tune from the checkpoint with the embedding held fixed
    pre = gpt().compile(device="cpu")
    train(pre, steps=2)
    pre.save_checkpoint(tmp_path / "pre.safetensors")
    tuned = gpt().compile(device="cpu", freeze=["tok_emb"])
    tuned.load_checkpoint(tmp_path / "pre.safetensors")
    feeds = batches(1, seed=5)[0]
    first = tuned.step(feeds, grads=False).loss
    opt = AdamW(lr=3e-3)
    for _ in range(10):
        tuned.step(feeds, optimizer=opt)
    assert tuned.step(feeds, grads=False).loss < first
    np.testing.assert_array_equal(tuned.params["tok_emb"], pre.params["tok_emb"])
    assert not np.array_equal(tuned.params["w_out"], pre.params["w_out"])
    # the gradient of a frozen param is no input of an update
    with pytest.raises(FlowError, match="'tok_emb' of tiny_gpt is frozen"):
        tuned.apply_update(opt, {name: np.zeros(v.shape, np.float32) for name, v in tuned.params.items()})


def test_unknown_names_are_errors_naming_them():
    with pytest.raises(FlowError, match="freeze: 'tok_embb' matches no param of tiny_gpt") as e:
        gpt().compile(device="cpu", freeze=["tok_embb"])
    assert "did you mean tok_emb?" in str(e.value)
    with pytest.raises(FlowError, match="did you mean decoder.[01]?"):
        gpt().compile(device="cpu", freeze=["decoder.2"])
    with pytest.raises(FlowError, match="takes a list of param names"):
        gpt().compile(device="cpu", freeze=[3])
    # globs: every param of every block instance; a glob matching nothing is an error too
    sess = gpt().compile(device="cpu", freeze=["decoder.*"])
    assert sess.graph.frozen == {n for n in sess.graph.params if n.startswith("decoder.")}
    with pytest.raises(FlowError, match="'encoder.\\*' matches no param"):
        gpt().compile(device="cpu", freeze=["encoder.*"])


TRAINED = """model trained
config {
  seq = 8
  vocab = 8
}
input tokens: i32[4, seq]
input targets: i32[4, seq]
param emb: f32[vocab, 8] = normal(std=0.5)
param w: f32[8, vocab] = xavier()
logits = embedding(tokens, emb) @ w
loss = cross_entropy(logits, targets)
output logits
minimize loss
train {
  data = reverse(seq=seq, vocab=vocab)
  optimizer = adamw(lr=1e-2, weight_decay=0.1)
  steps = 5
  freeze = FREEZE
}
"""


def test_the_train_section_freezes(tmp_path):
    model = fg.loads(TRAINED.replace("FREEZE", '["emb"]'), file="trained.flow")
    start = model.compile(device="cpu").params
    result = fg.train(model, device="cpu", progress=False)
    after = result.session.params
    np.testing.assert_array_equal(after["emb"], start["emb"])
    assert not np.array_equal(after["w"], start["w"])
    # an argument overrides the section
    result = fg.train(model, device="cpu", progress=False, freeze=["w"])
    assert result.session.graph.frozen == {"w"}


def test_an_unknown_name_in_the_train_section_is_an_error_at_its_line():
    from flowgrad.training.section import check_train

    model = fg.loads(TRAINED.replace("FREEZE", '["emb", "wout"]'), file="trained.flow")
    with pytest.raises(FlowError) as e:
        fg.train(model, device="cpu", progress=False)
    assert e.value.span.line == 18 and "'wout' matches no param of trained" in str(e.value)
    assert "trained.flow:18:" in str(e.value)
    errors = check_train(model.graph)
    assert [err.span.line for err in errors] == [18]


def test_explain_of_a_file_plans_with_its_train_section_frozen_params(tmp_path, capsys):
    from flowgrad.cli import main as cli_main

    path = tmp_path / "trained.flow"
    path.write_text(TRAINED.replace("FREEZE", '["emb"]'))
    assert cli_main(["explain", str(path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "frozen: emb (no gradient, no update)" in out
    assert "= param emb" in next(line for line in out.splitlines() if "frozen" in line and "%" in line)


@pytest.mark.parametrize("device", ["cpu", "vulkan"])
def test_a_loaded_optimizer_state_of_a_param_frozen_since_is_kept(request, tmp_path, device):
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    pre = gpt(layers=1).compile(device="cpu")
    train(pre, steps=2)
    pre.save_checkpoint(tmp_path / "pre.safetensors")
    _, saved = pre.runner.get_opt_state()
    sess = gpt(layers=1).compile(device=device, freeze=["tok_emb"])
    sess.load_checkpoint(tmp_path / "pre.safetensors")
    train(sess, steps=2)
    _, state = sess.runner.get_opt_state()
    for k, v in saved["tok_emb"].items():
        np.testing.assert_array_equal(state["tok_emb"][k], v, err_msg=k)
    assert not np.array_equal(state["w_out"]["exp_avg"], saved["w_out"]["exp_avg"])
