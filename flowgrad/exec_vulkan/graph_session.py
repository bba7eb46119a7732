"""The graph executor: a whole training step in one recorded command buffer.

Forward, backward and the optimizer update are recorded once (per mode:
forward only, with gradients, with an optimizer; see program.py) and the same
command buffer is submitted every step. Params, consts, optimizer state,
activations and gradients stay in device buffers laid out by the memory plan;
the host writes the feeds into a staging buffer that the step's first
commands copy in, and reads back only the outputs, the loss and the gradients
it asked for. GraphSession holds the resident leaves (params, consts,
optimizer state) and the programs, and answers the session API."""
from __future__ import annotations

import math
import statistics

import numpy as np

from flowgrad.dtypes import ITEMSIZE, NUMPY_DTYPE as NUMPY, dtype_of
from flowgrad.errors import DeviceError, FlowError
from flowgrad.exec_vulkan import profile
from flowgrad.exec_vulkan.oneshot import OneShot
from flowgrad.exec_vulkan.optim_records import update_record
from flowgrad.exec_vulkan.program import StepProgram, run_together
from flowgrad.exec_vulkan.recorder import BufView
from flowgrad.exec_vulkan.submit import Submission
from flowgrad.exec_vulkan.update_program import UpdateProgram
from flowgrad.graph import Graph
from flowgrad.grad_paths import updated_params
from flowgrad.update_counts import Counts


class GraphSession:
    """Same methods as exec_closure.ClosureSession, with everything resident."""

    path = "graph"
    last_path = "graph"

    def __init__(self, graph: Graph, plan, device, params: dict[str, np.ndarray], scaler=None, params_of=None):
        """params_of: a GraphSession whose resident params this one steps (the
        objectives of a model: flowgrad/objectives.py), else its own upload of `params`."""
        if device is None:
            raise DeviceError("the graph path needs a Vulkan device")
        if plan is not None and plan.path != "graph":
            raise FlowError(f"GraphSession given a plan that chose {plan.last_path}")
        # the training step's graph, fused: the model's nodes (same ids, params and outputs) and its backward's
        self.graph = plan.exec_graph
        self.plan, self.device = plan, device
        self.scaler = scaler   # a loss_scale.LossScaler under dtype="mixed"
        self.programs: dict[tuple, StepProgram] = {}
        self.shared: dict[tuple, dict] = {}        # (backward, grad_inputs) -> the memory plan's buffers
        self.opt_state: dict[int, dict] = {}       # id(optimizer) -> {param: {name: Buffer}}
        self.host_opt_state: dict = {}             # for an optimizer without a graph-path `record`
        self.counts = Counts()
        self.last_opt_key = None                   # the optimizer state get_opt_state reads
        self.loaded_opt_state: dict | None = None  # from set_opt_state, for optimizers not seen yet
        self.leaves: dict[tuple, object] = {}      # ("val", id) / ("seed",) -> Buffer
        self.borrowed: set = set()                 # the leaves that are params_of's (it frees them)
        self.together: dict = {}                   # step_together's submissions, by their command buffers
        if params_of is not None:
            self.borrowed = {("val", i) for i in self.graph.params.values()}
            self.leaves.update({key: params_of.leaves[key] for key in self.borrowed})
        # (param, its gradient's read-back name) for each trainable param, in the graph's order
        self._grad_keys = [(name, f"@grad:{name}") for name in self.graph.trainable()]
        self._upload_leaves(params)

    # -- resident leaves

    def _upload_leaves(self, params):
        g = self.graph
        missing = sorted(set(g.params) - set(params))
        if missing:
            raise FlowError(f"no initial value for param {missing[0]!r}")
        arrays = {}
        for name, i in g.params.items():
            if ("val", i) not in self.borrowed:
                arrays[("val", i)] = (params[name], g.nodes[i].dtype)
        for node in g.nodes:
            if node.op == "const":
                arrays[("val", node.id)] = (node.attrs["value"], node.dtype)
        if g.loss is not None:
            # with a loss scaler, each step uploads [scale, 1/scale] here: the seed reads the first
            arrays[("seed",)] = ((np.ones(g.nodes[g.loss].shape), g.nodes[g.loss].dtype) if self.scaler is None
                                 else (self._scale_words(), "f32"))
        for key, (value, dtype) in arrays.items():
            self.leaves[key] = self.device.buffer(max(math.prod(np.shape(value)) * ITEMSIZE[dtype], 4), "device")
        self._write_leaves(arrays)

    def _write_leaves(self, arrays: dict):
        with OneShot(self.device) as s:
            for key, (value, dtype) in arrays.items():
                s.write(BufView(self.leaves[key], 0, np.shape(value), dtype), value)
            s.run()

    def _scale_words(self) -> np.ndarray:
        return np.array([self.scaler.scale, self.scaler.inv_scale()], np.float32)

    def _feeds(self, feeds, prog) -> dict:
        """The step's feeds plus, when it runs a loss-scaled backward, the scale words."""
        return {**feeds, "@scale": self._scale_words()} if prog.layout.scale is not None else feeds

    def holds(self, node) -> bool:
        """Whether `node` (a const of a step's graph) is one of the session's leaves."""
        i = node.id
        return i < len(self.graph.nodes) and self.graph.nodes[i] is node and ("val", i) in self.leaves

    def write_consts(self, pairs) -> None:
        """Upload (view, array) pairs: a step graph's own constants."""
        if pairs:
            with OneShot(self.device) as s:
                for view, value in pairs:
                    s.write(view, value)
                s.run()

    def leaf_buffer(self, pb):
        (key,) = pb.values
        return self.leaves[key]

    def param_view(self, name) -> BufView:
        node = self.graph.nodes[self.graph.params[name]]
        return BufView(self.leaves[("val", node.id)], 0, node.shape, node.dtype)

    def optimizer_state_views(self, optimizer) -> dict:
        key = id(optimizer)
        if key not in self.opt_state:
            self._retire_optimizers()
            kept = getattr(optimizer, "STATE", None)
            if kept is not None and any(set(st) != set(kept) for st in (self.loaded_opt_state or {}).values()):
                self.counts = Counts()   # another kind of optimizer counts afresh, as a new torch one does
            trained = self.graph.trainable()
            state = optimizer.init_state({k: v for k, v in self.get_params().items() if k in trained})
            for pname, entries in (self.loaded_opt_state or {}).items():  # resumed from a checkpoint
                state.get(pname, {}).update({k: v for k, v in entries.items() if k in state.get(pname, {})})
            bufs = {}
            with OneShot(self.device) as s:
                for pname, entries in state.items():
                    bufs[pname] = {}
                    for k, arr in entries.items():
                        arr = np.ascontiguousarray(arr).reshape(np.shape(arr))
                        dtype = dtype_of(arr, narrow=True)
                        buf = self.device.buffer(max(arr.nbytes, 4), "device")
                        view = BufView(buf, 0, arr.shape, dtype)
                        s.write(view, arr)
                        bufs[pname][k] = view
                s.run()
            self.opt_state[key] = (optimizer, bufs)
        return self.opt_state[key][1]

    def _retire_optimizers(self) -> None:
        """Before a new optimizer object's first step: it goes on from the state
        the session holds, as on closures, whose one state every optimizer
        object steps. Without this a fresh object (one made per step to set
        its lr, say) started from zero moments at the session's step count, and
        each kept a recorded program and state buffers of its own. The state
        stepped so far becomes the loaded state; the programs and buffers of
        the optimizers that held it go."""
        if self.last_opt_key is None:
            return   # nothing stepped: a loaded state (if any) stands
        _, held = self.get_opt_state()
        self.loaded_opt_state = {p: {k: np.array(v, np.float32) for k, v in st.items()} for p, st in held.items()}
        self.host_opt_state = {}
        old = set(self.opt_state)
        for key in [k for k in self.programs if (k[1] if k[0] == "update" else k[2]) in old]:
            self.programs.pop(key).free()
        for _opt, bufs in self.opt_state.values():
            for entries in bufs.values():
                for view in entries.values():
                    view.buffer.free()
        self.opt_state.clear()
        self.last_opt_key = None

    # -- the step

    def _program(self, want_grads, grad_inputs, optimizer, outputs=None) -> StepProgram:
        on_device = optimizer if optimizer is not None and update_record(optimizer) is not None else None
        reads = None if outputs is None else tuple(n for n in self.graph.outputs if n in outputs)
        key = (bool(want_grads or (optimizer is not None and on_device is None)), bool(grad_inputs),
               None if on_device is None else id(on_device), reads)
        if key not in self.programs:
            self.programs[key] = StepProgram(self, key[0], key[1], on_device, reads)
        return self.programs[key]

    def plan_buffers(self, backward: bool, grad_inputs: bool) -> dict:
        """{memory plan buffer index: Buffer} of one kind of step, for every program of it."""
        return self.shared.setdefault((backward, grad_inputs), {})

    def step(self, feeds, grads: bool = True, optimizer=None, grad_inputs: bool = False, on_grad_final=None,
             outputs=None):
        """on_grad_final(name, grad): see session.Session.step; the backward is one
        submit, so every gradient is final when the step's results are read back.
        outputs: the names of the outputs to read back (None: all)."""
        prog, feeds, hyper = self.prepare(feeds, grads, optimizer, grad_inputs, outputs)
        got = prog.run(feeds, hyper)   # an index out of range raises: nothing is counted
        return self.finish(got, grads, optimizer, grad_inputs, on_grad_final, outputs)

    def prepare(self, feeds, grads: bool, optimizer, grad_inputs: bool, outputs=None):
        """(the program a step of this kind runs, its feeds, its hyper words):
        what StepProgram.run, or run_together with other objectives', takes."""
        prog = self._program(grads, grad_inputs, optimizer, outputs)
        if optimizer is not None:
            self.last_opt_key = id(optimizer) if prog.optimizer is not None else "host"
        hyper = self._hyper(optimizer) if prog.optimizer is not None else None
        return prog, self._feeds(feeds, prog), hyper

    def host_updates(self, grads: bool, optimizer, grad_inputs: bool) -> bool:
        """Whether a step of this kind updates the params on the host, after its read-back."""
        return optimizer is not None and update_record(optimizer) is None

    def finish(self, got: dict, grads: bool, optimizer, grad_inputs: bool, on_grad_final=None, outputs=None):
        """The step's (outputs, loss, gradients) from its program's read-back
        `got`; a host update, the counts and the loss scale move here."""
        g = self.graph
        on_host = self.host_updates(grads, optimizer, grad_inputs)
        found_inf = bool(got["@found_inf"][0]) if "@found_inf" in got else False   # the device skipped the update
        outputs = {name: got[name] for name in g.outputs if name in got}
        loss = got.get("@loss")
        out_grads = {}
        if grads or on_host:
            for name, key in self._grad_keys:
                grad = got.get(key)
                if grad is None:   # a param the loss does not reach
                    node = g.nodes[g.params[name]]
                    grad = np.zeros(node.shape, NUMPY[node.dtype])
                out_grads[name] = grad
            if grad_inputs:
                out_grads.update({name: got[f"@grad:{name}"] for name in g.inputs if f"@grad:{name}" in got})
        if on_grad_final is not None:
            for name, _key in self._grad_keys:
                on_grad_final(name, out_grads[name])
        if optimizer is not None:
            if on_host and not found_inf:
                self._host_update(optimizer, out_grads)
            self._count(found_inf)
        if not grads:
            out_grads = {}
        return outputs, loss, out_grads

    def apply_update(self, optimizer, grads: dict[str, np.ndarray]) -> None:
        """The optimizer update alone, on gradients the host supplies (averaged
        across ranks in data-parallel training): one submit of its own program.
        Under a loss scaler, skipped when one of them overflowed."""
        found_inf = self.scaler is not None and not all(np.isfinite(g).all() for g in grads.values())
        if update_record(optimizer) is None:
            self.last_opt_key = "host"
            if not found_inf:
                self._host_update(optimizer, grads)
            self._count(found_inf)
            return
        key = ("update", id(optimizer))
        if key not in self.programs:   # even for a skipped update: a new kind of optimizer restarts the counts here
            self.programs[key] = UpdateProgram(self, optimizer)
        self.last_opt_key = id(optimizer)
        if not found_inf:
            self.programs[key].run(grads, self._hyper(optimizer))
        self._count(found_inf)

    def _hyper(self, optimizer) -> np.ndarray:
        """The hyper array of the update asked for now, at the counts it has if applied."""
        at = self.counts.after()
        return np.asarray(optimizer.hyper(at.updates, at.iterations), np.float32)

    def _count(self, found_inf: bool) -> None:
        """An update asked for: counted, applied or skipped (update_counts.Counts), and the loss scale moved."""
        self.counts = self.counts.after(not found_inf)
        if self.scaler is not None:
            self.scaler.update(found_inf)

    def _host_update(self, optimizer, grads):
        """An optimizer without a graph-path `record`: update on the host (a round trip per step)."""
        trained = self.graph.trainable()
        params = {k: v for k, v in self.get_params().items() if k in trained}
        if not self.host_opt_state:
            self.host_opt_state = optimizer.init_state(params)
            for pname, entries in (self.loaded_opt_state or {}).items():
                self.host_opt_state.get(pname, {}).update(entries)
        at = self.counts.after()
        updated = {name: params[name] for name in updated_params(self.graph)}
        optimizer.update(updated, grads, self.host_opt_state, at.updates, at.iterations)
        self.set_params(updated)

    # -- params

    def get_params(self, names=None) -> dict[str, np.ndarray]:
        with OneShot(self.device) as s:
            names = list(self.graph.params if names is None else names)
            for name in names:
                s.download(self.param_view(name))
            return dict(zip(names, s.run()))

    def set_params(self, values: dict[str, np.ndarray]) -> None:
        arrays = {}
        for name, value in values.items():
            i = self.graph.params[name]
            arrays[("val", i)] = (value, self.graph.nodes[i].dtype)
        self._write_leaves(arrays)

    # -- optimizer state (checkpoints)

    def get_opt_state(self):
        """(Counts, {param: {state name: array}}) of the optimizer last stepped
        with, read back from the device: for checkpoints."""
        entry = self.opt_state.get(self.last_opt_key)
        if entry is None:
            host = self.host_opt_state if self.last_opt_key == "host" else (self.loaded_opt_state or {})
            return self.counts, {p: {k: np.array(v) for k, v in st.items()} for p, st in host.items()}
        bufs = entry[1]
        keys = [(p, k) for p, st in bufs.items() for k in st]
        with OneShot(self.device) as s:
            for p, k in keys:
                s.download(bufs[p][k])
            arrays = s.run()
        out = {p: {} for p in bufs}
        for (p, k), a in zip(keys, arrays):
            out[p][k] = a
        # a loaded state the device holds no buffers for (a param frozen since) is kept as it was
        out.update({p: {k: np.array(v) for k, v in st.items()} for p, st in (self.loaded_opt_state or {}).items()
                    if p not in out})
        return self.counts, out

    def set_opt_state(self, counts: Counts, state) -> None:
        """Restore what get_opt_state returned (resume): the next update goes
        on from these counts and state arrays."""
        self.counts = counts
        self.loaded_opt_state = {p: {k: np.array(v, np.float32) for k, v in st.items()} for p, st in state.items()}
        self.host_opt_state = {}
        with OneShot(self.device) as s:
            for _opt, bufs in self.opt_state.values():
                for p, entries in self.loaded_opt_state.items():
                    for k, arr in entries.items():
                        if k in bufs.get(p, {}):
                            s.write(bufs[p][k], arr)
            s.run()

    # -- profiling and teardown

    @property
    def timer(self) -> str:
        """How profile() measures: GPU timestamps, or wall time where the device has none."""
        return "gpu timestamps" if self.device.info.timestamps else "wall clock per section"

    def profile(self, feeds, steps: int = 3, grads: bool = True, optimizer=None,
                timer: str | None = None, nodes: bool = False, outputs=None) -> list[tuple]:
        """[(node label, direction, seconds)], one entry per recorded section
        in step order (medians over `steps` runs): GPU timestamps where the
        device has them, else (or with timer="wall") wall time of each section
        submitted alone. Directions: forward, backward, optimizer, and transfer
        (feeds in, read-back). With an optimizer, each profiled step updates the params too.
        nodes=True adds each section's node id in self.graph (None for a transfer, the
        optimizer or the loss scale): labels alone do not tell a rebound name's nodes apart.
        outputs: as step's."""
        prog = self._program(grads, False, optimizer, outputs)
        hyper = None if prog.optimizer is None else self._hyper(optimizer)
        feeds = self._feeds(feeds, prog)
        if (timer or ("gpu" if self.device.info.timestamps else "wall")) == "gpu":
            runs = profile.by_timestamps(self.device, prog, feeds, hyper, steps)
        else:
            runs = profile.by_wall_clock(self.device, prog, feeds, hyper, steps)
        return [(label[0], label[1], statistics.median(times)) + ((label[2] if len(label) > 2 else None,) * nodes)
                for label, times in runs]



    def close(self) -> None:
        for prog in self.programs.values():
            prog.free()
        self.programs.clear()
        for bufs in self.shared.values():
            for buf in bufs.values():
                buf.free()
        self.shared.clear()
        for key, buf in self.leaves.items():
            if key not in self.borrowed:
                buf.free()
        self.leaves.clear()
        for _opt, bufs in self.opt_state.values():
            for entries in bufs.values():
                for view in entries.values():
                    view.buffer.free()
        self.opt_state.clear()


def step_together(sessions: list[GraphSession], feeds, grads: bool, optimizers: list, grad_inputs: bool,
                  on_grad_final=None, outputs=None) -> list[tuple] | None:
    """The steps of a model's objectives (each session's, in order, over the
    first's params) in one submission: their command buffers in one batch,
    each seeing what the ones before it wrote (see submit.Submission), so
    each objective's forward reads the params as the update before it left
    them. [(outputs, loss, gradients)] of each, or None where a step needs
    the host between two of them: an update on the host (an optimizer without
    a graph-path record) before the last, or index checks, whose flags the
    host reads before the update may run (program.split_update). outputs:
    the first objective's outputs to read back (None: all); the others read none."""
    reads = [outputs] + [()] * (len(sessions) - 1)
    runs = [s.prepare(feeds, grads, opt, grad_inputs, r) for s, opt, r in zip(sessions, optimizers, reads)]
    if any(prog.update_submission is not None for prog, _f, _h in runs) or any(
            s.host_updates(grads, opt, grad_inputs) for s, opt in zip(sessions[:-1], optimizers[:-1])):
        return None
    cmds = tuple(prog.cmd for prog, _f, _h in runs)   # cffi pointers: equal and hashed by address
    together = sessions[0].together
    if cmds not in together:
        if len(together) > 8:   # those of programs freed since (a retired optimizer's) are never asked again
            together.clear()
        together[cmds] = Submission(*cmds)
    gots = run_together(sessions[0].device, runs, together[cmds])
    return [s.finish(got, grads, opt, grad_inputs, on_grad_final, r)
            for s, opt, got, r in zip(sessions, optimizers, gots, reads)]
