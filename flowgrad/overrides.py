"""Loading a model with --set overrides (and a trained one, from its
checkpoint, for `flowgrad run`, `generate` and `export`), and the error for
an override whose key is not a config key but a train setting or an
optimizer argument: `--set lr=1e-2` says where lr is written and how to
make it reachable."""
from __future__ import annotations

import numpy as np

from flowgrad.errors import FlowError


def load_model(file, sets: dict | None = None):
    """fg.load with overrides; a key that is not in the config but is a
    train setting or an optimizer argument gets an error saying so."""
    from flowgrad.api import load

    try:
        return load(file, sets)
    except FlowError as e:
        if not sets:
            raise
        try:
            base = load(file)
        except FlowError:
            raise e from None   # the defaults fail too: the error to show is the one of the model as overridden
        better = next((m for m in (not_a_config_key(base.graph, k, v) for k, v in sets.items()
                                   if k not in base.config) if m is not None), None)
        if better is None:
            raise
        raise better from e


def load_trained(file, ckpt_path, sets: dict | None = None, device: str = "auto", seed: int | None = None):
    """(session with the checkpoint's params, checkpoint): the config is the
    checkpoint's, `sets` (from --set) override it; the dtype is the params'.
    seed: the session's, which its predict calls draw randn_like noise from
    (default: the config's seed, else 0)."""
    from flowgrad.api import load
    from flowgrad.training import checkpoint

    ckpt = checkpoint.load(ckpt_path)
    base = load(file)
    config = {k: v for k, v in ckpt.config.items() if k in base.config and v != base.config[k]}
    config.update(sets or {})
    model = load_model(file, config) if config else base
    # a model trained with --dtype f16 runs in f16: the checkpoint says which
    dtype = "f16" if any(a.dtype == np.float16 for a in ckpt.params.values()) else "f32"
    sess = model.compile(device=device, dtype=dtype, seed=seed)
    checkpoint.check_matches(ckpt, sess.graph)
    sess.set_params(ckpt.params)
    return sess, ckpt


def not_a_config_key(graph, key: str, value: str) -> FlowError | None:
    """The error for `--set KEY=VALUE` where KEY names a train setting or an
    optimizer argument rather than a config key, at the train line using it."""
    from flowgrad.training import spec
    from flowgrad.training.section import TRAIN_KEYS
    from flowgrad.training.optim import OPTIMIZERS, Optimizer

    items = graph.train.items if graph.train is not None else {}
    spans = graph.train.spans if graph.train is not None else {}
    if key == "steps":
        return FlowError(f"--set steps={value}: steps is a train setting, not a config key", spans.get("steps"),
                         hint=f"pass --steps {value}")
    opt_args = {a for cls in OPTIMIZERS.values() for a in cls.ARGS} | set(Optimizer.COMMON)
    if key in opt_args:
        opt = spec.call_parts(items.get("optimizer", ("call", "adam", (), {})))
        given = opt[2].get(key) if opt else None
        shown = f" (the train section gives {key}={spec.show(given)})" if given is not None else ""
        return FlowError(f"--set {key}={value}: {key} is an optimizer argument{shown}, not a config key of "
                         f"{graph.name}", spans.get("optimizer") or spans.get(key),
                         hint=f"declare `{key} = ...` in config and write `{key}={key}` in the optimizer call "
                              f"(e.g. adam({key}={key})); then --set {key}=... reaches it")
    if key in TRAIN_KEYS:
        return FlowError(f"--set {key}={value}: {key} is a train setting, not a config key of {graph.name}",
                         spans.get(key), hint=f"declare `{key} = ...` in config and write `{key} = {key}` in the "
                                              "train section; then --set reaches it")
    return None
