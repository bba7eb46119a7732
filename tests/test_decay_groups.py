"""Weight-decay groups: `no_decay=[...]` exempts the params it names from
weight decay, as a torch param group with weight_decay=0 does: the numpy
update and the recorded one (one dispatch per param and several per
dispatch) against torch.optim with two param groups, a whole model on
numpy and on the Vulkan graph path against its PyTorch twin, and the errors."""
from __future__ import annotations

import numpy as np
import pytest

import flowgrad as fg
from flowgrad.errors import FlowError
from flowgrad.training.optim import SGD, Adam, AdamW
from conftest import needs_module
from test_optim_vulkan import device_steps, host_steps

SHAPES = {"w": (7, 5), "b": (5,), "ln_g": (5,), "ln_b": (5,), "emb.w": (4, 5)}
NO_DECAY = ["*b", "ln*"]   # b, ln_g, ln_b


def problem(steps=3, seed=0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(0, 1, s).astype(np.float32) for k, s in shapes.items()}
    grads = [{k: rng.normal(0, 0.1, s).astype(np.float32) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


OURS = {
    "adamw": lambda **kw: AdamW(lr=0.05, weight_decay=0.3, **kw),
    "adam": lambda **kw: Adam(lr=0.05, weight_decay=0.3, **kw),
    "sgd": lambda **kw: SGD(lr=0.1, momentum=0.9, weight_decay=0.3, **kw),
}
TORCH = {"adamw": ("AdamW", dict(lr=0.05)), "adam": ("Adam", dict(lr=0.05)),
         "sgd": ("SGD", dict(lr=0.1, momentum=0.9))}


def torch_steps(name, params, grads, decayed):
    """torch.optim's update in float64, with two param groups: decayed and not."""
    torch = needs_module("torch")
    ps = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in params.items()}
    cls, kw = TORCH[name]
    opt = getattr(torch.optim, cls)([{"params": [ps[k] for k in ps if k in decayed], "weight_decay": 0.3},
                                     {"params": [ps[k] for k in ps if k not in decayed], "weight_decay": 0.0}], **kw)
    for g in grads:
        for k, p in ps.items():
            p.grad = torch.tensor(g[k].astype(np.float64))
        opt.step()
    return {k: p.detach().numpy() for k, p in ps.items()}


@pytest.mark.parametrize("name", OURS)
def test_the_numpy_update_matches_torch_param_groups(name):
    params, grads = problem()
    got, _ = host_steps(OURS[name](no_decay=NO_DECAY), params, grads)
    want = torch_steps(name, params, grads, decayed={"w", "emb.w"})
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # and the groups matter: without no_decay, b decays
    plain, _ = host_steps(OURS[name](), params, grads)
    assert not np.allclose(plain["b"], got["b"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(plain["w"], got["w"])


@pytest.mark.vulkan
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("name", OURS)
def test_the_recorded_update_reads_each_params_row(vk_device, monkeypatch, name, batched):
    import flowgrad.exec_vulkan.multi_tensor as multi

    if not batched:
        monkeypatch.setattr(multi, "fits", lambda rec, bindings: False)
    params, grads = problem()
    want, _ = host_steps(OURS[name](no_decay=NO_DECAY), params, grads)
    got, _ = device_steps(vk_device, OURS[name](no_decay=NO_DECAY), params, grads, "f32")
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_the_hyper_array_has_a_row_without_decay():
    opt = AdamW(lr=0.1, weight_decay=0.2, no_decay=["b"])
    rows = opt.hyper(1).reshape(2, -1)
    h = [dict(zip(opt.HYPER, r)) for r in rows]
    assert h[0]["param_decay"] == np.float32(1 - 0.1 * 0.2) and h[1]["param_decay"] == 1.0
    assert {k: v for k, v in h[0].items() if k != "param_decay"} == {k: v for k, v in h[1].items()
                                                                     if k != "param_decay"}
    assert AdamW(lr=0.1).hyper(1).shape == (len(opt.HYPER),)   # one row without no_decay
    assert [opt.row(n) for n in ("b", "w", "dec.0.b")] == [1, 0, 0]


SMALL = {"vocab": 16, "seq": 8, "d": 16, "heads": 2, "layers": 1, "ff": 32, "batch": 4}
GPT_NO_DECAY = ["*_b", "*_g", "*.b?"]   # the norms' gains and biases, the MLP's biases


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, 16, (4, 8)).astype(np.int32),
             "targets": rng.integers(0, 16, (4, 8)).astype(np.int32)} for _ in range(n)]


def trained_by_torch(sess, feeds_list):
    torch = needs_module("torch")
    from flowgrad.param_patterns import matches
    from flowgrad.torch_twin import TorchTwin

    twin = TorchTwin(sess.graph, {k: v.astype(np.float64) for k, v in sess.params.items()})
    exempt = {n for n in twin.params if any(matches(n, p) for p in GPT_NO_DECAY)}
    assert {"lnf_g", "lnf_b", "decoder.0.b1", "decoder.0.ln1_b"} <= exempt and "decoder.0.w1" not in exempt
    opt = torch.optim.AdamW([{"params": [p for n, p in twin.params.items() if n not in exempt]},
                             {"params": [p for n, p in twin.params.items() if n in exempt], "weight_decay": 0.0}],
                            lr=1e-2, weight_decay=0.5)
    for feeds in feeds_list:
        opt.zero_grad()
        twin.step(twin.feeds(feeds))
        opt.step()
    return {n: p.detach().numpy() for n, p in twin.params.items()}


@pytest.mark.parametrize("device", ["cpu", "vulkan"])
def test_a_model_trains_as_torch_adamw_with_two_groups(request, device):
    if device == "vulkan":
        request.getfixturevalue("vk_device")
    model = fg.load("tiny_gpt", config=SMALL)
    sess = model.compile(device=device, backward="graph" if device == "vulkan" else "auto")
    feeds_list = batches(3)
    want = trained_by_torch(sess, feeds_list)
    opt = AdamW(lr=1e-2, weight_decay=0.5, no_decay=GPT_NO_DECAY)
    for feeds in feeds_list:
        sess.step(feeds, optimizer=opt)
    if device == "vulkan":
        assert sess.last_path == "graph"
    got = sess.params
    for name in got:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-4, atol=2e-5, err_msg=name)


def test_a_pattern_matching_no_param_is_an_error():
    sess = fg.load("tiny_gpt", config=SMALL).compile(device="cpu")
    with pytest.raises(FlowError, match=r"optimizer adamw\(\): no_decay: 'norm\*' matches no param of tiny_gpt"):
        sess.step(batches(1)[0], optimizer=AdamW(no_decay=["*_b", "norm*"]))
    assert sess.optimizer is None   # refused before the step
    with pytest.raises(FlowError, match="did you mean lnf_b"):
        sess.step(batches(1)[0], optimizer=AdamW(no_decay=["lnf_bb"]))
    with pytest.raises(FlowError, match="no_decay takes a list of param names"):
        AdamW(no_decay=[1])


SECTION = """model trained
config { vocab = 8 }
input tokens: i32[4, 8]
input targets: i32[4, 8]
param emb: f32[vocab, 8] = normal(std=0.5)
param w: f32[8, vocab] = xavier()
param b: f32[vocab] = zeros()
logits = embedding(tokens, emb) @ w + b
loss = cross_entropy(logits, targets)
output logits
minimize loss
train {
  data = reverse(seq=8, vocab=vocab)
  optimizer = adamw(lr=1e-2, weight_decay=0.5, no_decay=NO_DECAY)
  steps = 3
}
"""


def test_the_train_section_takes_no_decay():
    from flowgrad.training.section import check_train, setup

    model = fg.loads(SECTION.replace("NO_DECAY", '["b", "emb"]'), file="trained.flow")
    opt = setup(model.graph).optimizer
    assert opt.no_decay == ("b", "emb") and [opt.row(n) for n in ("emb", "w", "b")] == [1, 0, 1]
    result = fg.train(model, device="cpu", progress=False)
    assert result.steps == 3
    bad = fg.loads(SECTION.replace("NO_DECAY", '["b", "bias"]'), file="trained.flow")
    (err,) = check_train(bad.graph)
    assert err.span.line == 14 and "no_decay: 'bias' matches no param of trained" in str(err)
