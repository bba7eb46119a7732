"""Checkpoints: params AND optimizer state in one safetensors file.

Tensors: `param/<name>` for each param, `optim/<name>/<state>` for each
optimizer state array. Metadata (all strings, as safetensors wants):
format, version, model, step, config (JSON), optimizer (JSON), data (JSON:
what the data source keeps for inference, e.g. a text vocabulary; may be
absent), sha256 (over the tensors and the other metadata, so a flipped byte
is caught, in a tensor or in the step, not only a truncated file).

Writes are atomic: a temp file in the same directory (given the mode the
umask leaves, as open() would), fsync, os.replace, fsync of the directory. A write killed half-way leaves the previous checkpoint
as it was (and a stray `.<name>.*.tmp` that the next save removes)."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import attrs
import numpy as np

from flowgrad import objectives
from flowgrad.errors import FlowError
from flowgrad.dtypes import dtype_of
from flowgrad.graph import Graph
from flowgrad.update_counts import Counts

FORMAT = "flowgrad-checkpoint"
VERSION = "2"          # 2: the checksum covers the metadata; version 1 files are still read
FILENAME = "checkpoint.safetensors"


@attrs.frozen
class Checkpoint:
    params: dict[str, np.ndarray]
    opt_state: dict[str, dict[str, np.ndarray]]
    step: int
    model: str
    config: dict
    optimizer: dict | None
    path: str = ""
    data: dict | None = None


def _digest(tensors: dict[str, np.ndarray], meta: dict | None = None) -> str:
    h = hashlib.sha256()
    for key in sorted(meta or {}):
        if key != "sha256":
            h.update(json.dumps([key, meta[key]]).encode())
    for name in sorted(tensors):
        arr = np.asarray(tensors[name], order="C")
        h.update(f"{name}:{arr.dtype.str}:{arr.shape};".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def to_bytes(params, opt_state, step: int, model: str, config: dict, optimizer: dict | None,
             data: dict | None = None) -> bytes:
    from safetensors.numpy import save

    tensors = {f"param/{k}": np.asarray(v, order="C") for k, v in params.items()}
    for pname, states in (opt_state or {}).items():
        for sname, arr in states.items():
            tensors[f"optim/{pname}/{sname}"] = np.asarray(arr, order="C")
    meta = {"format": FORMAT, "version": VERSION, "model": model, "step": str(int(step)),
            "config": json.dumps(config, sort_keys=True, default=str),
            "optimizer": json.dumps(optimizer)}
    if data is not None:
        meta["data"] = json.dumps(data)
    meta["sha256"] = _digest(tensors, meta)
    return save(tensors, metadata=meta)


def write_atomic(path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)  # left by a write that was killed
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())   # mkstemp makes it 0600 whatever the umask says
        with os.fdopen(fd, "wb") as f:
            _write_all(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _umask() -> int:
    mask = os.umask(0o22)   # the only way to read it is to set it
    os.umask(mask)
    return mask


def _write_all(f, data: bytes) -> None:
    # its own function so a test can slow it down and kill the writer mid-write
    f.write(data)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # e.g. a platform without directory fds: the replace is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(path, params, opt_state, step: int, model: str, config: dict, optimizer: dict | None = None,
         data: dict | None = None) -> None:
    try:
        write_atomic(path, to_bytes(params, opt_state, step, model, config, optimizer, data))
    except OSError as e:
        raise FlowError(f"cannot write checkpoint {str(path)!r}: {e.strerror or e}") from None


def load(path) -> Checkpoint:
    """Read and verify a checkpoint; any defect is a FlowError naming the file."""
    from safetensors import SafetensorError, safe_open

    path = str(path)
    bad = f"{path!r} is not a usable flowgrad checkpoint"
    if not os.path.isfile(path):
        raise FlowError(f"no checkpoint file {path!r}")
    try:
        with safe_open(path, framework="np") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise FlowError(f"{bad}: the file is truncated or corrupt ({e})") from None
    if meta.get("format") != FORMAT:
        raise FlowError(f"{bad}: it is a safetensors file, but not one flowgrad wrote (no format={FORMAT} metadata)")
    if meta.get("version") not in ("1", VERSION):
        raise FlowError(f"{bad}: format version {meta.get('version')!r}; this flowgrad reads versions 1 and "
                        f"{VERSION}")
    if meta.get("sha256") != _digest(tensors, meta if meta["version"] != "1" else None):
        raise FlowError(f"{bad}: its tensors or metadata do not match their checksum (the file is corrupt)")
    try:
        step = int(meta["step"])
        config = json.loads(meta["config"])
        optimizer = json.loads(meta["optimizer"])
        model = meta["model"]
        data = json.loads(meta["data"]) if "data" in meta else None
    except (KeyError, ValueError) as e:
        raise FlowError(f"{bad}: bad metadata ({e})") from None
    for key, value, none_ok in (("config", config, False), ("optimizer", optimizer, True), ("data", data, True)):
        if not isinstance(value, dict) and not (none_ok and value is None):
            raise FlowError(f"{bad}: bad metadata ({key} is a JSON {_json_kind(value)}, not an object"
                            f"{' or null' if none_ok else ''})")
    if step < 0:
        raise FlowError(f"{bad}: its step is {step}, a negative number")
    params, opt_state = {}, {}
    for name, arr in tensors.items():
        kind, _, rest = name.partition("/")
        if kind == "param":
            params[rest] = arr
        elif kind == "optim" and "/" in rest:
            pname, _, sname = rest.rpartition("/")
            opt_state.setdefault(pname, {})[sname] = arr
        else:
            raise FlowError(f"{bad}: unexpected tensor {name!r}")
    return Checkpoint(params, opt_state, step, model, config, optimizer, path, data)


def _json_kind(value) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def mismatches(ckpt: Checkpoint, graph: Graph) -> list[str]:
    """Every way the checkpoint's params differ from the model's: missing,
    unexpected, wrong shape, wrong dtype (one line each)."""
    out = []
    want = {name: graph.nodes[i].type for name, i in graph.params.items()}
    for name, t in want.items():
        arr = ckpt.params.get(name)
        if arr is None:
            out.append(f"param {name} ({t}) is missing from the checkpoint")
            continue
        if tuple(arr.shape) != t.shape:
            out.append(f"param {name}: the model has shape {list(t.shape)}, the checkpoint {list(arr.shape)}")
        try:
            got = dtype_of(arr)
        except TypeError:
            got = str(arr.dtype)
        if got != t.dtype:
            out.append(f"param {name}: the model has dtype {t.dtype}, the checkpoint {got}")
    for name in ckpt.params:
        if name not in want:
            out.append(f"param {name} is in the checkpoint but not in the model")
    return out


def check_matches(ckpt: Checkpoint, graph: Graph) -> None:
    problems = mismatches(ckpt, graph)
    if problems:
        raise FlowError(f"checkpoint {ckpt.path!r} (model {ckpt.model}) does not match model {graph.name} "
                        f"({len(problems)} mismatch{'es' if len(problems) > 1 else ''}):\n"
                        + "\n".join(f"  - {p}" for p in problems))


def check_opt_state(ckpt: Checkpoint, optimizer, params: dict[str, np.ndarray]) -> None:
    """The saved optimizer state must be what `optimizer` keeps for `params`."""
    saved = (ckpt.optimizer or {}).get("name")
    if saved != optimizer.describe()["name"]:
        raise FlowError(f"checkpoint {ckpt.path!r} was trained with optimizer {saved}, not {optimizer.name}; "
                        "resuming needs the same optimizer")
    if not ckpt.opt_state and optimizer_counts(ckpt).updates == 0:
        return   # every step so far was skipped (loss scaling): no state yet, and none is needed
    problems = stray_opt_state(ckpt, params)
    for pname, p in params.items():
        have = ckpt.opt_state.get(pname, {})
        for sname in optimizer.STATE:
            arr = have.get(sname)
            if arr is None:
                problems.append(f"optimizer state {pname}/{sname} is missing")
            elif arr.shape != p.shape or arr.dtype != np.float32:
                problems.append(f"optimizer state {pname}/{sname} is {arr.dtype}{list(arr.shape)}, "
                                f"expected float32{list(p.shape)}")
        problems += [f"optimizer state {pname}/{s} is not kept by {optimizer.name}"
                     for s in have if s not in optimizer.STATE]
    if problems:
        raise FlowError(f"checkpoint {ckpt.path!r}: its optimizer state does not fit:\n"
                        + "\n".join(f"  - {p}" for p in problems))


def stray_opt_state(ckpt: Checkpoint, trainable) -> list[str]:
    """The checkpoint's optimizer state for names that are not among the
    `trainable` params (one line each): resumed, it would not be state of
    this model's, and a runner would take the set for another optimizer's."""
    return [f"optimizer state {pname}/{sname} is for {pname}, which is not a param of the model"
            for pname, states in ckpt.opt_state.items() if pname not in trainable for sname in states]


def check_no_stray_opt_state(ckpt: Checkpoint, graph: Graph) -> None:
    """A frozen param's state is the model's (kept for when it trains again); a lacking param's is not.
    With several objectives each keeps its own, under `objective/param`."""
    from flowgrad.param_patterns import declared_params

    problems = stray_opt_state(ckpt, objectives.state_names(graph, declared_params(graph)))
    if problems:
        raise FlowError(f"checkpoint {ckpt.path!r}: its optimizer state does not fit:\n"
                        + "\n".join(f"  - {p}" for p in problems))


def check_resumable(ckpt: Checkpoint, optimizer, graph: Graph) -> None:
    """The saved optimizer state must be what `optimizer` keeps for the
    trainable params: with several objectives, each objective's (under
    `objective/param`) what its optimizer keeps for its params."""
    meta = ckpt.optimizer or {}
    names = objectives.objective_names(graph)
    saved = meta.get("objectives")
    if objectives.several(graph) != (saved is not None) or (saved is not None and (
            not isinstance(saved, dict) or sorted(saved) != sorted(names))):
        had = ", ".join(saved) if isinstance(saved, dict) else "one objective"
        raise FlowError(f"checkpoint {ckpt.path!r} was written for {had}, and {graph.name} minimizes "
                        f"{', '.join(names)}: resuming needs the same `minimize` statements")
    if saved is None:
        trained = graph.trainable()
        check_opt_state(ckpt, optimizer, {k: v for k, v in ckpt.params.items() if k in trained})
        return
    counts = {k: meta[k] for k in ("updates", "iterations") if k in meta}
    for name, part, opt in zip(names, objectives.objective_graphs(graph), objectives.per_objective(optimizer, graph)):
        prefix = f"{name}/"
        # the objective's own count of updates where it kept one
        own = attrs.evolve(ckpt, optimizer={**counts, **saved[name]} if isinstance(saved[name], dict) else None,
                           opt_state={k[len(prefix):]: v for k, v in ckpt.opt_state.items() if k.startswith(prefix)})
        trained = part.trainable()
        check_opt_state(own, opt, {k: v for k, v in ckpt.params.items() if k in trained})


def save_session(sess, path, optimizer=None) -> None:
    """Session.save_checkpoint: params, and the optimizer state the session's
    runner holds (with the optimizer that made it, when known)."""
    counts, state = sess.runner.get_opt_state()
    describe = objectives.describe(optimizer or sess.optimizer, sess.graph)   # None, or loaded
    # its step is the iterations: what fg.train's step is, so a run resumed from it goes on alike
    save(path, sess.params, state, counts.iterations, sess.graph.name, sess.graph.config,
         optimizer_meta(describe, sess, counts))


def optimizer_meta(describe: dict | None, sess, counts: Counts) -> dict | None:
    """The checkpoint's `optimizer` metadata: the optimizer's description, the
    loss scaler's state, and its Counts, `updates` and `iterations`. Under
    dtype="mixed" a skipped step applies no update, so Adam's bias correction
    counts fewer steps than the lr schedule: a resume that took one count for
    both would go on from another point than the run did."""
    meta = with_loss_scale(describe, sess)
    if meta is None:
        return None
    each = getattr(counts, "each", ())
    if each and isinstance(meta.get("objectives"), dict):
        # each loss scaler skips its own objective's updates: each objective keeps its count
        meta = {**meta, "objectives": {name: {**own, "updates": int(each[name].updates)} if name in each else own
                                       for name, own in meta["objectives"].items()}}
    return {**meta, "updates": int(counts.updates), "iterations": int(counts.iterations)}


def optimizer_counts(ckpt: Checkpoint) -> Counts:
    """The optimizer's Counts at the checkpoint (files without them: the
    checkpoint's step); with several objectives that kept a count each,
    ObjectiveCounts."""
    meta = ckpt.optimizer or {}
    iterations = meta.get("iterations", ckpt.step)
    first = _checked_counts(ckpt, meta.get("updates", ckpt.step), iterations)
    saved = meta.get("objectives")
    if not isinstance(saved, dict) or not all(isinstance(d, dict) and "updates" in d for d in saved.values()):
        return first
    each = {name: _checked_counts(ckpt, d["updates"], iterations, f" of objective {name}") for name, d in saved.items()}
    return objectives.ObjectiveCounts(first.updates, first.iterations, each)


def _checked_counts(ckpt: Checkpoint, updates, iterations, what: str = "") -> Counts:
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (updates, iterations)) \
            or not 0 <= updates <= iterations <= ckpt.step:
        raise FlowError(f"checkpoint {ckpt.path!r}: bad optimizer counts{what} (updates {updates!r}, iterations "
                        f"{iterations!r}; ints with 0 <= updates <= iterations <= its step, {ckpt.step})")
    return Counts(updates, iterations)


def with_loss_scale(describe: dict | None, sess) -> dict | None:
    """The optimizer's description plus, under dtype="mixed", the loss
    scaler's state (with several objectives each one's, by its name): a
    resumed run goes on with the scale it had."""
    scalers = getattr(sess, "loss_scalers", None) or []
    if describe is None or not scalers:
        return describe
    if not objectives.several(sess.graph):
        return {**describe, "loss_scale": scalers[0].state()}
    names = objectives.objective_names(sess.graph)
    return {**describe, "loss_scale": {"objectives": {n: s.state() for n, s in zip(names, scalers)}}}


def restore_loss_scale(ckpt: Checkpoint, sess) -> None:
    saved = (ckpt.optimizer or {}).get("loss_scale")
    scalers = getattr(sess, "loss_scalers", None) or []
    if saved is None or not scalers:
        return
    names = objectives.objective_names(sess.graph)
    each = saved.get("objectives") if isinstance(saved, dict) and objectives.several(sess.graph) else None
    if objectives.several(sess.graph) and (not isinstance(each, dict) or sorted(each) != sorted(names)):
        raise FlowError(f"checkpoint {ckpt.path!r}: bad loss-scale state {saved!r} (one for each objective: "
                        f"{', '.join(names)})")
    for scaler, state in zip(scalers, [each[n] for n in names] if each is not None else [saved]):
        try:
            scaler.load_state(state)
        except (KeyError, TypeError, ValueError) as e:
            raise FlowError(f"checkpoint {ckpt.path!r}: bad loss-scale state {state!r} ({e})") from None


def load_into_session(sess, path) -> Checkpoint:
    """Session.load_checkpoint: refuse a mismatch (listing each), then set the
    params and, when the checkpoint has them, the optimizer state and step."""
    ckpt = load(path)
    check_matches(ckpt, sess.graph)
    check_no_stray_opt_state(ckpt, sess.graph)
    sess.runner.set_params(ckpt.params)
    if ckpt.optimizer is not None:
        sess.runner.set_opt_state(optimizer_counts(ckpt), ckpt.opt_state)
        sess.train_steps = max(sess.train_steps, ckpt.step)   # dropout masks go on from the checkpoint's step
        if sess.optimizer is None:
            sess.optimizer = ckpt.optimizer  # its description: saving again keeps it
        restore_loss_scale(ckpt, sess)
    return ckpt
