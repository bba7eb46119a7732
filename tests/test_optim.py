"""Optimizer updates against values worked out by hand (PyTorch's formulas),
clipping, schedules, and the errors for bad optimizer settings. No device."""
from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import needs_module

from flowgrad.errors import FlowError
from flowgrad.graph import Span
from flowgrad.training.optim import SGD, Adam, AdamW, make_optimizer
from flowgrad.training.schedules import Schedule
from flowgrad.update_counts import Counts


def run(opt, grads_per_step, p0=1.0):
    """Apply the optimizer to one scalar param for the given grads; returns p after each step."""
    params = {"w": np.array([p0], np.float32)}
    state = opt.init_state(params)
    out = []
    for step, g in enumerate(grads_per_step, start=1):
        opt.update(params, {"w": np.array([g], np.float32)}, state, step)
        out.append(float(params["w"][0]))
    return out


def test_sgd_plain():
    assert run(SGD(lr=0.1), [0.5, 0.5]) == pytest.approx([0.95, 0.90], abs=1e-7)


def test_sgd_weight_decay():
    # g' = 0.5 + 0.1 * 1.0 = 0.6  ->  1 - 0.1 * 0.6
    assert run(SGD(lr=0.1, weight_decay=0.1), [0.5]) == pytest.approx([0.94], abs=1e-7)


def test_sgd_momentum():
    # buf: 0.5, 0.9*0.5+0.5=0.95, 0.9*0.95+0.5=1.355; p -= 0.1*buf
    assert run(SGD(lr=0.1, momentum=0.9), [0.5] * 3) == pytest.approx([0.95, 0.855, 0.7195], abs=1e-6)


def test_sgd_dampening_not_on_first_step():
    # buf1 = g = 0.5 (PyTorch copies the first grad), buf2 = 0.9*0.5 + 0.5*0.5 = 0.7
    assert run(SGD(lr=0.1, momentum=0.9, dampening=0.5), [0.5, 0.5]) == pytest.approx([0.95, 0.88], abs=1e-6)


def test_sgd_one_minus_dampening_is_exact():
    # 1 - f32(0.9999) is 1.000166e-4: the buffer took the gradient 1.7e-4 too strongly
    opt = SGD(lr=1.0, momentum=1e-3, dampening=0.9999)
    params = {"w": np.zeros(1, np.float32)}
    state = opt.init_state(params)
    for step in (1, 2):
        opt.update(params, {"w": np.ones(1, np.float32)}, state, step)
    assert state["w"]["momentum_buffer"][0] == pytest.approx(1e-3 + 1e-4, rel=1e-6)


def test_sgd_nesterov():
    # step 1: buf=0.5, d = 0.5 + 0.9*0.5 = 0.95; step 2: buf=0.95, d = 0.5 + 0.855 = 1.355
    assert run(SGD(lr=0.1, momentum=0.9, nesterov=True), [0.5, 0.5]) == pytest.approx([0.905, 0.7695], abs=1e-6)


def adam_by_hand(grads, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, decoupled=False, p=1.0):
    m = v = 0.0
    out = []
    for t, g in enumerate(grads, start=1):
        if decoupled:
            p *= 1 - lr * wd
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        p -= lr * m_hat / (math.sqrt(v_hat) + eps)
        out.append(p)
    return out


def test_adam_first_steps():
    got = run(Adam(lr=0.1), [0.5, -1.0, 0.25])
    # step 1 by hand: m_hat = 0.5, v_hat = 0.25 -> p = 1 - 0.1 * 0.5 / 0.5 = 0.9
    assert got[0] == pytest.approx(0.9, abs=1e-6)
    # step 2 by hand: m = -0.055, v = 0.00124975, m_hat = -0.2894737, v_hat = 0.6251876 -> p = 0.9366101
    assert got[1] == pytest.approx(0.9366101, abs=1e-6)
    assert got == pytest.approx(adam_by_hand([0.5, -1.0, 0.25], 0.1), abs=1e-6)


def test_adam_weight_decay_is_added_to_the_gradient():
    got = run(Adam(lr=0.1, weight_decay=0.1), [0.5, -1.0, 0.25])
    assert got == pytest.approx(adam_by_hand([0.5, -1.0, 0.25], 0.1, wd=0.1), abs=1e-6)


def test_adamw_decays_the_param_itself():
    got = run(AdamW(lr=0.1, weight_decay=0.1), [0.5, -1.0, 0.25])
    # step 1: p = 1 * (1 - 0.01) = 0.99, then - 0.1 * 0.5/0.5 -> 0.89
    assert got[0] == pytest.approx(0.89, abs=1e-6)
    assert got == pytest.approx(adam_by_hand([0.5, -1.0, 0.25], 0.1, wd=0.1, decoupled=True), abs=1e-6)


def test_adam_one_minus_beta_is_exact():
    # f32(0.99999) = 0.99998999: 1 - that is 1.00136e-5, not 1e-5. The first step
    # moves p by exactly lr (m_hat = g, v_hat = g²) only with 1 - β2 taken in double.
    assert run(Adam(lr=0.1, betas=[0.9, 0.99999]), [0.5]) == pytest.approx([0.9], abs=1e-7)
    assert run(AdamW(lr=0.1, betas=[0.9, 0.9999], weight_decay=0.0), [-2.0]) == pytest.approx([1.1], abs=1e-7)


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_matches_torch_over_many_steps(name):
    torch = needs_module("torch")   # the optional extra flowgrad[torch]
    rng = np.random.default_rng(3)
    p0 = rng.normal(0, 1, (20, 30)).astype(np.float32)
    grads = [(rng.normal(0, 1, p0.shape) * 10.0 ** rng.uniform(-4, 0, p0.shape)).astype(np.float32)
             for _ in range(50)]
    kw = dict(lr=0.01, betas=(0.9, 0.9999), eps=1e-8, weight_decay=0.1)
    ours = (Adam if name == "adam" else AdamW)(**{**kw, "betas": list(kw["betas"])})
    params = {"w": p0.copy()}
    state = ours.init_state(params)
    tp = torch.tensor(p0.copy(), requires_grad=True)
    theirs = (torch.optim.Adam if name == "adam" else torch.optim.AdamW)([tp], **kw)
    for t, g in enumerate(grads, start=1):
        ours.update(params, {"w": g}, state, t)
        tp.grad = torch.tensor(g)
        theirs.step()
    np.testing.assert_allclose(params["w"], tp.detach().numpy(), rtol=0, atol=2e-6)


def test_pytorch_defaults():
    assert (SGD().lr, SGD().momentum, SGD().nesterov) == (1e-3, 0.0, False)
    a, w = Adam(), AdamW()
    assert (a.lr, a.betas, a.eps, a.weight_decay) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert (w.lr, w.betas, w.eps, w.weight_decay) == (1e-3, (0.9, 0.999), 1e-8, 1e-2)


def test_clip_by_global_norm():
    # grads (3, 4) have norm 5: with clip=1 each is scaled by 1 / (5 + 1e-6)
    opt = SGD(lr=1.0, clip=1.0)
    params = {"a": np.zeros(1, np.float32), "b": np.zeros(1, np.float32)}
    grads = {"a": np.array([3.0], np.float32), "b": np.array([4.0], np.float32)}
    opt.update(params, grads, opt.init_state(params), 1)
    assert params["a"][0] == pytest.approx(-3 / (5 + 1e-6), rel=1e-6)
    assert params["b"][0] == pytest.approx(-4 / (5 + 1e-6), rel=1e-6)
    assert grads["a"][0] == 3.0  # the caller's gradients are not modified


def test_clip_leaves_small_gradients_alone():
    opt = SGD(lr=1.0, clip=10.0)
    params = {"a": np.zeros(2, np.float32)}
    opt.update(params, {"a": np.array([3.0, 4.0], np.float32)}, {"a": {}}, 1)
    np.testing.assert_allclose(params["a"], [-3.0, -4.0])


def test_clip_applies_before_adam():
    opt = Adam(lr=0.1, clip=0.1)
    got = run(opt, [0.5, -1.0])
    scaled = [0.5 * 0.1 / (0.5 + 1e-6), -1.0 * 0.1 / (1.0 + 1e-6)]
    assert got == pytest.approx(adam_by_hand(scaled, 0.1), abs=1e-6)


def test_f16_params_update_in_f32_and_keep_their_dtype():
    opt = Adam(lr=1e-3)
    params = {"w": np.ones(4, np.float16)}
    state = opt.init_state(params)
    opt.update(params, {"w": np.full(4, 0.5, np.float16)}, state, 1)
    assert params["w"].dtype == np.float16 and state["w"]["exp_avg"].dtype == np.float32
    np.testing.assert_allclose(params["w"].astype(np.float32), np.float16(0.999), rtol=1e-3)


def test_hyper_layout_matches_names():
    opt = Adam(lr=0.01)
    h = opt.hyper(2)
    assert h.dtype == np.float32 and len(h) == len(opt.HYPER)
    named = dict(zip(opt.HYPER, h))
    assert named["step_size"] == pytest.approx(0.01 / (1 - 0.9 ** 2))
    assert named["inv_sqrt_bc2"] == pytest.approx(1 / math.sqrt(1 - 0.999 ** 2))


# -- schedules -------------------------------------------------------------------

def test_cosine_with_warmup():
    s = Schedule("cosine", warmup=2, total=6)
    got = [s.factor(t) for t in range(1, 7)]
    # warmup: 1/2, 2/2; then cos over the 4 remaining steps at progress 0, 1/4, 2/4, 3/4
    want = [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]
    assert got == pytest.approx(want)


def test_constant_and_linear_and_min_lr():
    assert [Schedule("constant", warmup=4).factor(t) for t in (1, 2, 4, 100)] == [0.25, 0.5, 1.0, 1.0]
    assert [Schedule("linear", total=4).factor(t) for t in (1, 2, 3, 4)] == pytest.approx([1, 0.75, 0.5, 0.25])
    assert Schedule("cosine", total=3, min_factor=0.1).factor(3) == pytest.approx(0.1 + 0.9 * 0.25)
    # a run shorter than its warmup (--steps 5) just stays in the warmup
    assert [Schedule("cosine", warmup=10, total=5).factor(t) for t in (1, 5)] == pytest.approx([0.1, 0.5])


def test_schedule_drives_the_lr_of_updates():
    opt = make_optimizer(("call", "sgd", (), {"lr": 1.0, "schedule": "cosine", "warmup": 2}), None, total_steps=6)
    assert [opt.lr_at(t) for t in (1, 2, 3)] == pytest.approx([0.5, 1.0, 1.0])
    assert run(opt, [1.0, 1.0]) == pytest.approx([0.5, -0.5])


def test_a_schedule_without_total_steps_is_an_error_not_min_lr():
    opt = Adam(lr=0.1, schedule="cosine", warmup=2)
    with pytest.raises(FlowError, match="needs the run's length"):
        run(opt, [0.5, 0.5, 0.5])
    assert run(Adam(lr=0.1, warmup=2), [0.5]) == pytest.approx([0.95], abs=1e-6)   # constant needs none



def test_a_session_refuses_a_schedule_without_total_steps_before_stepping():
    import flowgrad as fg

    sess = fg.loads("model m\ninput x: f32[2, 3]\nparam w: f32[3] = ones()\nloss = sum(x * w)\nminimize loss\n"
                    ).compile(device="cpu")
    with pytest.raises(FlowError, match="needs the run's length"):
        sess.step({"x": np.ones((2, 3), np.float32)}, optimizer=SGD(lr=0.1, schedule="linear"))
    assert sess.runner.get_opt_state()[0] == Counts() and sess.params["w"].tolist() == [1.0, 1.0, 1.0]


def test_a_callable_schedule_is_a_multiplier_as_lambda_lr():
    """torch.optim.lr_scheduler.LambdaLR: update t (1-based) uses lr * f(t - 1)."""
    calls = []
    opt = SGD(lr=0.5, schedule=lambda s: calls.append(s) or 0.1 * (s + 1))
    assert run(opt, [1.0, 1.0, 1.0]) == pytest.approx([1 - 0.05, 1 - 0.05 - 0.1, 1 - 0.05 - 0.1 - 0.15])
    assert calls == [0, 1, 2]
    assert opt.lr_at(4) == pytest.approx(0.5 * 0.4)
    assert SGD(lr=1.0, schedule=lambda s: np.float32(0.5)).lr_at(1) == 0.5   # numpy scalars are numbers


def test_a_callable_schedule_matches_torch_lambda_lr():
    torch = needs_module("torch")   # the optional extra flowgrad[torch]
    f = lambda s: 0.9 ** s if s > 2 else (s + 1) / 3   # noqa: E731
    ours = Adam(lr=0.1, schedule=f)
    tp = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    theirs = torch.optim.Adam([tp], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(theirs, f)
    for t in range(1, 8):
        assert ours.lr_at(t) == pytest.approx(theirs.param_groups[0]["lr"], rel=1e-12)
        tp.grad = torch.ones(1, dtype=torch.float64)
        theirs.step()
        sched.step()


@pytest.mark.parametrize("fn, message", [
    (lambda s: -1.0, r"schedule\(2\), for update 3, gave -1.0; it must give a finite number >= 0, the multiplier"),
    (lambda s: "x", r"schedule\(2\), for update 3, gave 'x'"),
    (lambda s: float("nan") if s else 1.0, "gave nan; it must give a finite number"),
    (lambda s: True, "gave True"),
    (lambda s: 1 / 0 if s == 2 else 1.0, r"schedule\(2\), for update 3, raised ZeroDivisionError: division by zero"),
])
def test_a_callable_schedules_bad_value_is_a_flow_error(fn, message):
    opt = SGD(lr=0.5, schedule=fn)
    with pytest.raises(FlowError, match=message):
        opt.lr_at(3)


def test_a_callable_schedule_refuses_warmup_and_min_lr():
    with pytest.raises(FlowError, match="warmup= and min_lr= go with the named schedules"):
        SGD(lr=0.5, schedule=lambda s: 1.0, warmup=3)
    with pytest.raises(FlowError, match="schedule must be a string"):
        SGD(lr=0.5, schedule=3)


def test_optimizer_arguments_take_numpy_scalars():
    opt = Adam(lr=np.float32(1e-3), betas=(np.float64(0.9), np.float32(0.99)), eps=np.float32(1e-8))
    assert type(opt.lr) is float and opt.lr == pytest.approx(1e-3)
    assert SGD(lr=np.int64(1), momentum=np.float16(0.5)).momentum == 0.5
    assert Adam(warmup=np.int32(3)).schedule.warmup == 3
    with pytest.raises(FlowError, match="lr must be a number"):
        Adam(lr=np.bool_(True))
    with pytest.raises(FlowError, match="warmup must be an integer"):
        Adam(warmup=np.float32(3))


# -- built from the train section ----------------------------------------------------

SPAN = Span("m.flow", 30, 15, "  optimizer = adma(lr=1e-3)", 41)


def test_make_optimizer_from_train_value():
    opt = make_optimizer(("call", "adamw", (), {"lr": 3e-4, "betas": [0.9, 0.95], "clip": 1.0}), SPAN, 100)
    assert isinstance(opt, AdamW) and opt.lr == 3e-4 and opt.betas == (0.9, 0.95) and opt.clip == 1.0
    assert make_optimizer(("call", "sgd", (0.5,), {}), SPAN).lr == 0.5  # positional lr, as in PyTorch


def test_schedule_on_its_own_line():
    opt = make_optimizer(("call", "adam", (), {}), SPAN, 50, {"schedule": ("cosine", SPAN), "warmup": (5, SPAN)})
    assert opt.schedule == Schedule("cosine", 5, 50, 0.0)


@pytest.mark.parametrize("value, message", [
    (("call", "adma", (), {}), "unknown optimizer 'adma'"),
    (("call", "adam", (), {"betas1": 0.9}), "has no argument 'betas1'"),
    (("call", "adam", (), {"lr": -1.0}), "lr must be > 0"),
    (("call", "adam", (), {"lr": "fast"}), "lr must be a number"),
    (("call", "adam", (), {"betas": [0.9]}), "betas must be a list of two numbers"),
    (("call", "sgd", (), {"nesterov": True}), "nesterov momentum needs momentum > 0"),
    (("call", "sgd", (), {"schedule": "cosin"}), "unknown schedule 'cosin'"),
    (("call", "sgd", (1, 2, 3, 4, 5, 6), {}), "at most 5 positional"),
    (1e-3, "optimizer must be a call"),
])
def test_bad_optimizer_is_a_flow_error_at_the_span(value, message):
    with pytest.raises(FlowError) as e:
        make_optimizer(value, SPAN, total_steps=10)
    assert message in str(e.value)
    assert str(e.value).startswith("m.flow:30:15:")  # points at the train-section line


def test_did_you_mean():
    with pytest.raises(FlowError) as e:
        make_optimizer(("call", "adma", (), {}), SPAN)
    assert "did you mean adam?" in str(e.value)
    with pytest.raises(FlowError) as e:
        make_optimizer(("call", "adam", (), {"weight_decya": 0.1}), SPAN)
    assert "did you mean weight_decay?" in str(e.value)
