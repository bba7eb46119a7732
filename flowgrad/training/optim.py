"""Optimizers: sgd (momentum, dampening, nesterov, weight_decay), adam and
adamw, with PyTorch's semantics and defaults; global-norm gradient clipping
(`clip=` on any of them) and learning-rate schedules (`schedule=`, `warmup=`).

Each implements the Optimizer protocol both sessions use:

    init_state(params) -> {param: {state name: f32 array}}
    hyper(step, iteration) -> f32 array   per-step scalars, laid out as HYPER
    update(params, grads, state, step, iteration)   numpy, in place (closure path)

The graph path records the same update into its command buffer
(flowgrad/exec_vulkan/optim_records.py, by the optimizer's name).

`step` is the update's number among those applied, `iteration` its number
among those asked for (update_counts.Counts): they differ once the loss
scaler skipped one.

The numpy update and the shaders read the SAME hyper array, so the two paths
differ only in arithmetic order. Updates are computed in f32 (f16 params are
upcast, updated, and cast back); optimizer state is always f32.

Clipping follows torch.nn.utils.clip_grad_norm_: grads are scaled by
min(1, clip / (norm + 1e-6)) where norm is the L2 norm over ALL grads. It
scales the gradient the update sees, not the gradients a step returns.

`no_decay=[...]` (param names, block prefixes or globs: flowgrad.param_patterns)
exempts params from weight decay, as a second torch param group with
weight_decay=0 does. The hyper array then holds two rows of HYPER, the
second with the decay taken out, and each param's update reads its row."""
from __future__ import annotations

import math

import numpy as np

from flowgrad.binder import did_you_mean
from flowgrad.errors import FlowError
from flowgrad.param_patterns import matches, patterns_of, select
from flowgrad.training import spec
from flowgrad.training.schedules import SCHEDULES, Schedule

CLIP_EPS = 1e-6       # torch.nn.utils.clip_grad_norm_'s


class Optimizer:
    """Shared parts: argument checks, lr schedule, clipping, the f32 update
    loop. Subclasses list their own arguments in ARGS (name ->
    PyTorch's default, in PyTorch's order); COMMON ones follow."""

    name = ""
    ARGS: dict = {}
    COMMON = {"clip": None, "schedule": "constant", "warmup": 0, "min_lr": 0.0, "no_decay": None}
    HYPER: tuple[str, ...] = ()
    STATE: tuple[str, ...] = ()
    clip_eps = CLIP_EPS

    def __init__(self, *args, total_steps: int = 0, span=None, **kwargs):
        a = spec.bind("optimizer", self.name, args, kwargs, self.signature(), span, positional=len(self.ARGS))
        what = f"optimizer {self.name}()"
        self.lr = spec.number(what, "lr", a["lr"], span, low=0.0, low_open=True)
        clip = a["clip"]
        self.clip = None if clip is None else spec.number(what, "clip", clip, span, low=0.0, low_open=True)
        warmup = spec.number(what, "warmup", a["warmup"], span, low=0, integer=True)
        min_lr = spec.number(what, "min_lr", a["min_lr"], span, low=0.0, high=self.lr)
        total = spec.number(what, "total steps", total_steps, span, low=0, integer=True)
        if callable(a["schedule"]):
            if warmup or min_lr:
                raise FlowError(f"{what}: warmup= and min_lr= go with the named schedules; a schedule function "
                                "gives the whole multiplier of lr", span)
            self.schedule = Schedule("lambda", total=total, fn=a["schedule"])
        else:
            kind = spec.string(what, "schedule", a["schedule"], span, SCHEDULES)
            self.schedule = Schedule(kind, warmup, total, min_lr / self.lr)
        self.no_decay = () if a["no_decay"] is None else patterns_of(a["no_decay"], f"{what}: no_decay", span)
        self.span = span   # where a no_decay pattern that names no param is reported
        self._rows: dict[str, int] = {}
        self._configure(a, what, span)

    @classmethod
    def signature(cls) -> dict:
        return {**cls.ARGS, **cls.COMMON}

    @property
    def lr(self) -> float:
        """The base lr, which the schedule multiplies. Set between steps, the
        next update uses it (as torch's param_groups[0]["lr"] without a scheduler)."""
        return self._lr

    @lr.setter
    def lr(self, value) -> None:
        self._lr = spec.number(f"optimizer {self.name}()", "lr", value, None, low=0.0, low_open=True)

    # -- the protocol -------------------------------------------------------
    def lr_at(self, step: int) -> float:
        if self.schedule.needs_total and self.schedule.total == 0:
            # over no steps the schedule would be at min_lr from the first step after warmup on
            raise FlowError(f"optimizer {self.name}(): schedule={self.schedule.kind!r} needs the run's length, "
                            "and total_steps was not given",
                            hint="pass total_steps=N (fg.train and the train section set it to the run's steps)")
        return self.lr * self.schedule.factor(step)

    def hyper(self, step: int, iteration: int | None = None) -> np.ndarray:
        """iteration: the schedule's step (by default `step`: no update skipped).
        With no_decay, a second row of the same values without weight decay."""
        lr = self.lr_at(step if iteration is None else iteration)
        decays = [self.weight_decay, 0.0] if self.no_decay else [self.weight_decay]
        rows = [self._hyper(step, lr, wd) for wd in decays]
        return np.array([row[k] for row in rows for k in self.HYPER], dtype=np.float32)

    def row(self, name: str) -> int:
        """The hyper row param `name` reads: 1 when no_decay exempts it from weight decay."""
        if name not in self._rows:
            self._rows[name] = int(any(matches(name, p) for p in self.no_decay))
        return self._rows[name]

    def check_params(self, names, model: str) -> None:
        """Each no_decay pattern must name one of `names` (a model's params)."""
        select(names, self.no_decay, f"optimizer {self.name}(): no_decay", model, self.span)

    def init_state(self, params: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
        return {name: {k: np.zeros(p.shape, np.float32) for k in self.STATE} for name, p in params.items()}

    def update(self, params, grads, state, step: int, iteration: int | None = None) -> None:
        rows = self.hyper(step, iteration).reshape(-1, len(self.HYPER))
        hs = [dict(zip(self.HYPER, row)) for row in rows]
        scale = np.float32(self.clip_scale(grads))
        for name, p in params.items():
            g = grads[name].astype(np.float32)
            if scale != 1:
                g = g * scale
            new = self._update_one(p.astype(np.float32), g, state[name], hs[self.row(name)])
            p[...] = new.astype(p.dtype)

    def clip_scale(self, grads) -> float:
        if self.clip is None:
            return 1.0
        total = math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads.values()))
        return min(1.0, self.clip / (total + CLIP_EPS))

    def describe(self) -> dict:
        """What a checkpoint records, to refuse resuming with another optimizer."""
        return {"name": self.name, "state": list(self.STATE)}

    # -- per optimizer ------------------------------------------------------
    def _configure(self, a: dict, what: str, span) -> None:
        raise NotImplementedError

    def _hyper(self, step: int, lr: float, weight_decay: float) -> dict:
        raise NotImplementedError

    def _update_one(self, p, g, st, h) -> np.ndarray:
        raise NotImplementedError


class SGD(Optimizer):
    """torch.optim.SGD: with weight decay d, momentum m, dampening τ:
    g += d·p;  buf = g on the first step, else m·buf + (1-τ)·g;
    g = g + m·buf (nesterov) or buf;  p -= lr·g.
    1-τ comes in the hyper array, computed in double (as Adam's 1-β)."""

    name = "sgd"
    ARGS = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}
    HYPER = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "first", "one_minus_dampening")

    def _configure(self, a, what, span):
        self.momentum = spec.number(what, "momentum", a["momentum"], span, low=0.0)
        self.dampening = spec.number(what, "dampening", a["dampening"], span)
        self.weight_decay = spec.number(what, "weight_decay", a["weight_decay"], span, low=0.0)
        self.nesterov = spec.boolean(what, "nesterov", a["nesterov"], span)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise FlowError(f"{what}: nesterov momentum needs momentum > 0 and dampening = 0", span)
        # plain SGD keeps no state, as in PyTorch
        self.STATE = ("momentum_buffer",) if self.momentum else ()

    def _hyper(self, step, lr, weight_decay):
        return {"lr": lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": weight_decay, "nesterov": float(self.nesterov), "first": float(step == 1),
                "one_minus_dampening": 1.0 - self.dampening}

    def _update_one(self, p, g, st, h):
        if h["weight_decay"]:
            g = g + h["weight_decay"] * p
        if "momentum_buffer" in st:
            buf = st["momentum_buffer"]
            if h["first"]:
                buf[...] = g
            else:
                buf *= h["momentum"]
                buf += h["one_minus_dampening"] * g
            g = g + h["momentum"] * buf if h["nesterov"] else buf
        return p - h["lr"] * g


class Adam(Optimizer):
    """torch.optim.Adam; AdamW when decoupled:
    p *= 1 - lr·d (AdamW) | g += d·p (Adam);  m = β1·m + (1-β1)·g;
    v = β2·v + (1-β2)·g²;  p -= lr/(1-β1ᵗ) · m / (sqrt(v)/sqrt(1-β2ᵗ) + eps).
    1-β1 and 1-β2 come in the hyper array, computed in double as PyTorch does:
    1 - f32(β) loses β's low bits (β2 = 0.999 gives 0.99998713e-3, and the
    bias correction, exact in double, then no longer cancels)."""

    name = "adam"
    ARGS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    HYPER = ("lr", "beta1", "beta2", "eps", "grad_decay", "param_decay", "step_size", "inv_sqrt_bc2",
             "one_minus_beta1", "one_minus_beta2")
    STATE = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def _configure(self, a, what, span):
        betas = a["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise FlowError(f"{what}: betas must be a list of two numbers, e.g. betas=[0.9, 0.999], "
                            f"got {spec.show(betas)}", span)
        self.betas = tuple(spec.number(what, "betas", b, span, low=0.0, high=1.0, high_open=True) for b in betas)
        self.eps = spec.number(what, "eps", a["eps"], span, low=0.0)
        self.weight_decay = spec.number(what, "weight_decay", a["weight_decay"], span, low=0.0)

    def _hyper(self, step, lr, wd):
        b1, b2 = self.betas
        return {"lr": lr, "beta1": b1, "beta2": b2, "eps": self.eps,
                "grad_decay": 0.0 if self.decoupled else wd,
                "param_decay": 1.0 - lr * wd if self.decoupled else 1.0,
                "step_size": lr / (1.0 - b1 ** step), "inv_sqrt_bc2": 1.0 / math.sqrt(1.0 - b2 ** step),
                "one_minus_beta1": 1.0 - b1, "one_minus_beta2": 1.0 - b2}

    def _update_one(self, p, g, st, h):
        if h["grad_decay"]:
            g = g + h["grad_decay"] * p
        p = p * h["param_decay"]
        m, v = st["exp_avg"], st["exp_avg_sq"]
        m *= h["beta1"]
        m += h["one_minus_beta1"] * g
        v *= h["beta2"]
        v += h["one_minus_beta2"] * g * g
        return p - h["step_size"] * m / (np.sqrt(v) * h["inv_sqrt_bc2"] + h["eps"])


class AdamW(Adam):
    name = "adamw"
    ARGS = {**Adam.ARGS, "weight_decay": 1e-2}
    decoupled = True


OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def make_optimizer(value, span=None, total_steps: int = 0, extra: dict | None = None) -> Optimizer:
    """Build an optimizer from a train-section value, e.g.
    ("call", "adam", (), {"lr": 1e-3}). `extra`: Optimizer.COMMON keys given
    on their own train-section lines (`schedule = cosine`), {key: (value, span)}."""
    parts = spec.call_parts(value)
    if parts is None:
        raise FlowError(f"optimizer must be a call like adam(lr=1e-3), got {spec.show(value)}", span,
                        hint=f"optimizers: {', '.join(OPTIMIZERS)}")
    name, args, kwargs = parts
    cls = OPTIMIZERS.get(name)
    if cls is None:
        raise FlowError(f"unknown optimizer {name!r} (one of: {', '.join(OPTIMIZERS)})", span,
                        hint=did_you_mean(name, OPTIMIZERS))
    for key, (val, key_span) in (extra or {}).items():
        if key in kwargs:
            raise FlowError(f"{key} is given both in the optimizer call and on its own line", key_span)
        kwargs[key] = val
    return cls(*args, total_steps=total_steps, span=span, **kwargs)
