"""The graph executor: a whole training step in one recorded command buffer.

Forward, backward and the optimizer update are recorded once (per mode:
forward only, with gradients, with an optimizer) and the same command buffer
is submitted every step. Params, consts, optimizer state, activations and
gradients stay in device buffers laid out by the memory plan; the host writes
the feeds into a staging buffer that the step's first commands copy in, and
reads back only the outputs, the loss and the gradients it asked for.

The executor never looks at op names: each node's work comes from its op's
lowering, recorded inside a section labelled with the node, so profiling
(`profile`) and dispatch counting (`count_dispatches`, no device) see the
same commands."""
from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import time
import weakref

import numpy as np

from flowgrad.errors import DeviceError, FlowError
from flowgrad.exec_vulkan.oneshot import OneShot
from flowgrad.exec_vulkan.recorder import (ALIGN, NUMPY, BufView, FakeBuffer, Recorder, align_up, count_barriers,
                                           encode, grid, read_timestamps)
from flowgrad.graph import Graph
from flowgrad.ops import get_op
from flowgrad.planner.memory import MemoryPlan, backward_nodes, plan_memory


def accumulate(rec, dst: BufView, src: BufView) -> None:
    """dst += src (same shape and dtype)."""
    rec.dispatch("accumulate", [dst, src], push=[dst.size], groups=grid(dst.size),
                 variant="f16" if dst.dtype == "f16" else None)


class StepIO:
    """Where the host's data enters and leaves one step: regions of an upload
    and a download staging buffer, and the device views they are copied to
    and from."""

    def __init__(self):
        self.uploads: list[tuple[str, BufView, BufView]] = []     # (name, staging, device)
        self.downloads: list[tuple[str, BufView, BufView]] = []   # (name, device, staging)
        self.up_bytes = 0
        self.down_bytes = 0

    def upload_region(self, staging, shape, dtype) -> BufView:
        view = BufView(staging, self.up_bytes, shape, dtype)
        self.up_bytes = align_up(self.up_bytes + max(view.nbytes, 1), ALIGN)
        return view

    def download_region(self, staging, shape, dtype) -> BufView:
        view = BufView(staging, self.down_bytes, shape, dtype)
        self.down_bytes = align_up(self.down_bytes + max(view.nbytes, 1), ALIGN)
        return view


def record_step(rec: Recorder, graph: Graph, mem: MemoryPlan, view, io: StepIO, optimizer_record=None) -> None:
    """Record one step: feeds in, forward, backward (with gradient
    accumulation), read-backs, then the optimizer update."""
    with rec.section("feeds", "transfer"):
        for _name, staging, device_view in io.uploads:
            rec.copy(staging, device_view)
    nodes = graph.nodes
    for step in mem.schedule:
        if step.kind == "optimizer":
            continue
        node = nodes[step.node]
        low = get_op(node.op).lowering
        ins = [view(("val", i)) for i in node.inputs]
        out = view(("val", node.id))
        if step.kind == "forward":
            with rec.section(node.label, "forward"), _lowering_errors(node, "forward"):
                low.forward(rec, node, ins, out)
            continue
        writes = mem.grad_writes[node.id]
        grads = [None] * len(node.inputs)
        for w in writes:
            grads[w.pos] = view(w.key)
        with rec.section(node.label, "backward"), _lowering_errors(node, "backward"):
            low.backward(rec, node, view(("grad", node.id)), ins, out, grads)
            for w in writes:
                if w.accumulate_into is not None:
                    accumulate(rec, view(w.accumulate_into), view(w.key))
    with rec.section("read-back", "transfer"):
        for _name, device_view, staging in io.downloads:
            rec.copy(device_view, staging)
    if optimizer_record is not None:
        with rec.section("optimizer", "optimizer"):
            optimizer_record(rec)


@contextlib.contextmanager
def _lowering_errors(node, direction):
    """A lowering that rejects its node (ValueError) becomes a FlowError at the node's source line."""
    try:
        yield
    except ValueError as e:
        raise FlowError(f"{node.label} = {node.op}(...): the Vulkan {direction} lowering cannot run it: {e}",
                        node.span, hint="compile with backward='closures' to run it on closures") from e


class _Layout:
    """The buffers and I/O of one step program, over real or fake buffers."""

    def __init__(self, graph, mem, make_buffer, leaf_buffer, want_grads, grad_inputs, optimizer, staging):
        self.graph, self.mem = graph, mem
        self.buffers = []
        for pb in mem.buffers:
            if pb.kind in ("param", "const", "seed"):
                self.buffers.append(leaf_buffer(pb))
            else:
                self.buffers.append(make_buffer(pb.nbytes, f"buffer{pb.index}"))
        self.io = StepIO()
        up, down = staging
        for name, i in graph.inputs.items():
            if ("val", i) in mem.slots:
                node = graph.nodes[i]
                self.io.uploads.append((name, self.io.upload_region(up, node.shape, node.dtype), self.view(("val", i))))
        self.hyper = None
        self.zero_grads: dict[str, BufView] = {}
        if optimizer is not None and hasattr(optimizer, "record"):
            h = np.asarray(optimizer.hyper(1), np.float32)
            self.hyper = BufView(make_buffer(max(h.nbytes, 4), "hyper"), 0, h.shape, "f32")
            self.io.uploads.append(("@hyper", self.io.upload_region(up, h.shape, "f32"), self.hyper))
        for name, i in graph.outputs.items():
            self._download(name, ("val", i), down)
        if graph.loss is not None and ("val", graph.loss) in mem.slots:
            self._download("@loss", ("val", graph.loss), down)
        if want_grads:
            for name, i in graph.params.items():
                if ("grad", i) in mem.slots:
                    self._download(f"@grad:{name}", ("grad", i), down)
            if grad_inputs:
                for name, i in graph.inputs.items():
                    if ("grad", i) in mem.slots:
                        self._download(f"@grad:{name}", ("grad", i), down)

    def _download(self, name, key, staging):
        src = self.view(key)
        self.io.downloads.append((name, src, self.io.download_region(staging, src.shape, src.dtype)))

    def view(self, key) -> BufView:
        s = self.mem.slots[key]
        return BufView(self.buffers[s.buffer], s.offset, s.shape, s.dtype)

    def param_grads(self, make_buffer) -> dict[str, BufView]:
        """Each param's gradient view; a param the loss does not reach gets a zeroed buffer."""
        out = {}
        for name, i in self.graph.params.items():
            if ("grad", i) in self.mem.slots:
                out[name] = self.view(("grad", i))
            else:
                node = self.graph.nodes[i]
                if name not in self.zero_grads:
                    self.zero_grads[name] = BufView(make_buffer(node.type.nbytes, f"zero-grad:{name}"), 0,
                                                    node.shape, node.dtype)
                out[name] = self.zero_grads[name]
        return out


class _Program:
    """One recorded step (for one mode) and the device objects it owns."""

    def __init__(self, sess: GraphSession, want_grads: bool, grad_inputs: bool, optimizer):
        device, graph = sess.device, sess.graph
        self.device = device
        self.optimizer = optimizer
        backward = want_grads or optimizer is not None
        self.mem = plan_memory(graph, sess.plan, backward=backward, grad_inputs=grad_inputs)
        sess.check_backward(self.mem)
        owned = []

        def make_buffer(nbytes, _name):
            buf = device.buffer(nbytes, "device")
            owned.append(buf)
            return buf

        up, down = _LazyStaging(device, "upload"), _LazyStaging(device, "download")
        self.layout = _Layout(graph, self.mem, make_buffer, sess.leaf_buffer, want_grads, grad_inputs,
                              optimizer, (up, down))
        self.owned = owned
        opt_record = None
        if optimizer is not None and hasattr(optimizer, "record"):
            grads = self.layout.param_grads(make_buffer)
            state = sess.optimizer_state_views(optimizer)
            params = {name: sess.param_view(name) for name in graph.params}
            hyper = self.layout.hyper
            zero = dict(self.layout.zero_grads)

            def opt_record(rec):
                for v in zero.values():
                    rec.fill(v, 0)
                optimizer.record(rec, params, grads, state, hyper)
        self.rec = Recorder(device)
        record_step(self.rec, graph, self.mem, self.layout.view, self.layout.io, opt_record)
        self.dispatches = self.rec.counts()["dispatches"]
        self.staging_up = up.materialize(self.layout.io.up_bytes)
        self.staging_down = down.materialize(self.layout.io.down_bytes)
        self.owned += [b for b in (self.staging_up, self.staging_down) if b is not None]
        self.host = None   # the host block read-backs land in (see read_outputs)
        self.rec.arena.materialize(device)
        self.cmd = device.command_buffer()
        self.enc = encode(device, self.cmd, self.rec.commands)
        self._finalizer = weakref.finalize(self, _free_program, device, self.cmd, self.enc, owned, self.rec.arena)
        self._finalizer.atexit = False

    def write_inputs(self, feeds: dict, hyper) -> None:
        for name, staging, _dev in self.layout.io.uploads:
            data = hyper if name == "@hyper" else feeds[name]
            if tuple(np.shape(data)) != staging.shape:
                what = "the optimizer's hyper(step)" if name == "@hyper" else f"feed {name!r}"
                raise FlowError(f"{what} has shape {list(np.shape(data))}; the recorded step expects "
                                f"{list(staging.shape)}")
            self.staging_up.write(np.ascontiguousarray(data, dtype=NUMPY[staging.dtype]), staging.offset)

    def read_outputs(self) -> dict[str, np.ndarray]:
        """Every read-back of the step in one copy, out of the staging buffer
        into one host block; the arrays handed out are views of that block.
        A fresh block costs a page fault per 4 KiB on first touch (tens of ms
        for a model's gradients), so the block is reused whenever no array of
        the previous step is still held; one still held keeps its values."""
        io = self.layout.io
        if not io.downloads:
            return {}
        if self.host is None or sys.getrefcount(self.host) > 2:  # the attribute and the call's argument
            self.host = np.empty(io.down_bytes, np.uint8)
        _parallel_copy(self.host, self.staging_down.array[:io.down_bytes])
        block = self.host
        return {name: block[s.offset:s.offset + s.nbytes].view(NUMPY[s.dtype]).reshape(s.shape)
                for name, _dev, s in io.downloads}

    def run(self, feeds, hyper=None) -> dict[str, np.ndarray]:
        stats = self.device.stats
        stats["dispatches"] += self.dispatches
        stats["uploads"] += len(self.layout.io.uploads)
        stats["downloads"] += len(self.layout.io.downloads)
        self.write_inputs(feeds, hyper)
        self.device.submit_and_wait(self.cmd, "running a graph step")
        return self.read_outputs()

    def free(self) -> None:
        self._finalizer()


_COPY_CHUNK = 8 << 20


def _parallel_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src; a large copy in chunks on several threads (numpy copies
    without the GIL), since one core reads host memory at a fraction of
    what the memory system gives several."""
    n = dst.size
    if n < 2 * _COPY_CHUNK:
        np.copyto(dst, src)
        return
    pool = _copy_pool()
    list(pool.map(lambda lo: np.copyto(dst[lo:lo + _COPY_CHUNK], src[lo:lo + _COPY_CHUNK]),
                  range(0, n, _COPY_CHUNK)))


@functools.cache
def _copy_pool():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="flowgrad-read-back")


def _free_program(device, cmd, enc, owned, arena):
    if device.handle is None:
        return
    device.free_command_buffer(cmd)
    enc.free()
    for buf in owned:
        buf.free()
    arena.free()


class _LazyStaging:
    """A staging buffer whose size is known only after the layout is built."""

    def __init__(self, device, kind):
        self.device, self.kind, self.buffer = device, kind, None

    def materialize(self, nbytes):
        if nbytes:
            self.buffer = self.device.buffer(nbytes, self.kind)
        return self.buffer

    @property
    def handle(self):
        return self.buffer.handle


class GraphSession:
    """Same methods as exec_closure.ClosureSession, with everything resident."""

    path = "graph"
    last_path = "graph"

    def __init__(self, graph: Graph, plan, device, params: dict[str, np.ndarray]):
        if device is None:
            raise DeviceError("the graph path needs a Vulkan device")
        if plan is not None and plan.path != "graph":
            raise FlowError(f"GraphSession given a plan that chose {plan.last_path}")
        self.graph, self.plan, self.device = graph, plan, device
        self.programs: dict[tuple, _Program] = {}
        self.opt_state: dict[int, dict] = {}       # id(optimizer) -> {param: {name: Buffer}}
        self.host_opt_state: dict = {}             # for an optimizer without a graph-path `record`
        self.opt_step = 0
        self.last_opt_key = None                   # the optimizer state get_opt_state reads
        self.loaded_opt_state: dict | None = None  # from set_opt_state, for optimizers not seen yet
        self.leaves: dict[tuple, object] = {}      # ("val", id) / ("seed",) -> Buffer
        self._upload_leaves(params)

    # -- resident leaves

    def _upload_leaves(self, params):
        g = self.graph
        missing = sorted(set(g.params) - set(params))
        if missing:
            raise FlowError(f"no initial value for param {missing[0]!r}")
        arrays = {}
        for name, i in g.params.items():
            arrays[("val", i)] = (params[name], g.nodes[i].dtype)
        for node in g.nodes:
            if node.op == "const":
                arrays[("val", node.id)] = (node.attrs["value"], node.dtype)
        if g.loss is not None:
            arrays[("seed",)] = (np.ones(g.nodes[g.loss].shape), g.nodes[g.loss].dtype)
        for key, (value, dtype) in arrays.items():
            self.leaves[key] = self.device.buffer(max(np.asarray(value, NUMPY[dtype]).nbytes, 4), "device")
        self._write_leaves({k: v for k, v in arrays.items()})

    def _write_leaves(self, arrays: dict):
        with OneShot(self.device) as s:
            for key, (value, dtype) in arrays.items():
                data = np.ascontiguousarray(value, dtype=NUMPY[dtype]).reshape(np.shape(value))
                s.write(BufView(self.leaves[key], 0, data.shape, dtype), data)
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
            state = optimizer.init_state(self.get_params())
            for pname, entries in (self.loaded_opt_state or {}).items():  # resumed from a checkpoint
                state.get(pname, {}).update({k: v for k, v in entries.items() if k in state.get(pname, {})})
            bufs = {}
            with OneShot(self.device) as s:
                for pname, entries in state.items():
                    bufs[pname] = {}
                    for k, arr in entries.items():
                        arr = np.ascontiguousarray(arr).reshape(np.shape(arr))
                        dtype = "f16" if arr.dtype == np.float16 else "i32" if arr.dtype.kind in "iu" else "f32"
                        buf = self.device.buffer(max(arr.nbytes, 4), "device")
                        view = BufView(buf, 0, arr.shape, dtype)
                        s.write(view, arr)
                        bufs[pname][k] = view
                s.run()
            self.opt_state[key] = (optimizer, bufs)
        return self.opt_state[key][1]

    def check_backward(self, mem: MemoryPlan) -> None:
        """grad_inputs can reach nodes the planner did not check; refuse them
        here rather than fail inside a lowering."""
        for nid in mem.backward_nodes:
            node = self.graph.nodes[nid]
            low = get_op(node.op).lowering
            if low is None or low.backward is None or node.dtype not in low.bwd_dtypes:
                raise FlowError(f"{node.label} = {node.op}(...) has no graph backward for {node.dtype}; "
                                "compile with backward='closures' to differentiate it", node.span)

    # -- the step

    def _program(self, want_grads, grad_inputs, optimizer) -> _Program:
        on_device = optimizer if optimizer is not None and hasattr(optimizer, "record") else None
        key = (bool(want_grads or (optimizer is not None and on_device is None)), bool(grad_inputs),
               None if on_device is None else id(on_device))
        if key not in self.programs:
            self.programs[key] = _Program(self, key[0], key[1], on_device)
        return self.programs[key]

    def step(self, feeds, grads: bool = True, optimizer=None, grad_inputs: bool = False):
        g = self.graph
        prog = self._program(grads, grad_inputs, optimizer)
        hyper = None
        if optimizer is not None:
            self.last_opt_key = id(optimizer) if prog.optimizer is not None else "host"
        if prog.optimizer is not None:
            self.opt_step += 1
            hyper = np.asarray(optimizer.hyper(self.opt_step), np.float32)
        got = prog.run(feeds, hyper)
        outputs = {name: got[name] for name in g.outputs}
        loss = got.get("@loss")
        out_grads = {}
        if grads or (optimizer is not None and prog.optimizer is None):
            for name, i in g.params.items():
                out_grads[name] = got.get(f"@grad:{name}")
                if out_grads[name] is None:
                    out_grads[name] = np.zeros(g.nodes[i].shape, NUMPY[g.nodes[i].dtype])
            if grad_inputs:
                out_grads.update({name: got[f"@grad:{name}"] for name in g.inputs if f"@grad:{name}" in got})
        if optimizer is not None and prog.optimizer is None:
            self._host_update(optimizer, out_grads)
        if not grads:
            out_grads = {}
        return outputs, loss, out_grads

    def _host_update(self, optimizer, grads):
        """An optimizer without a graph-path `record`: update on the host (a round trip per step)."""
        params = self.get_params()
        if not self.host_opt_state:
            self.host_opt_state = optimizer.init_state(params)
            for pname, entries in (self.loaded_opt_state or {}).items():
                self.host_opt_state.get(pname, {}).update(entries)
        self.opt_step += 1
        optimizer.update(params, grads, self.host_opt_state, self.opt_step)
        self.set_params(params)

    # -- params

    def get_params(self) -> dict[str, np.ndarray]:
        with OneShot(self.device) as s:
            names = list(self.graph.params)
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
        """(optimizer steps taken, {param: {state name: array}}) of the optimizer
        last stepped with, read back from the device: for checkpoints."""
        entry = self.opt_state.get(self.last_opt_key)
        if entry is None:
            host = self.host_opt_state if self.last_opt_key == "host" else (self.loaded_opt_state or {})
            return self.opt_step, {p: {k: np.array(v) for k, v in st.items()} for p, st in host.items()}
        bufs = entry[1]
        keys = [(p, k) for p, st in bufs.items() for k in st]
        with OneShot(self.device) as s:
            for p, k in keys:
                s.download(bufs[p][k])
            arrays = s.run()
        out = {p: {} for p in bufs}
        for (p, k), a in zip(keys, arrays):
            out[p][k] = a
        return self.opt_step, out

    def set_opt_state(self, step: int, state) -> None:
        """Restore what get_opt_state returned (resume): the next update is
        step + 1, starting from these state arrays."""
        self.opt_step = int(step)
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
                timer: str | None = None) -> list[tuple[str, str, float]]:
        """[(node label, direction, seconds)], one entry per recorded section
        in step order (medians over `steps` runs): GPU timestamps where the
        device has them, else (or with timer="wall") wall time of each section
        submitted alone. Directions: forward, backward, optimizer, and transfer
        (feeds in, read-back). With an optimizer, each profiled step updates the params too."""
        prog = self._program(grads, False, optimizer)
        hyper = None if prog.optimizer is None else np.asarray(optimizer.hyper(max(self.opt_step, 1)), np.float32)
        if (timer or ("gpu" if self.device.info.timestamps else "wall")) == "gpu":
            runs = self._profile_timestamps(prog, feeds, hyper, steps)
        else:
            runs = self._profile_wall(prog, feeds, hyper, steps)
        return [(label[0], label[1], statistics.median(times)) for label, times in runs]

    def _profile_timestamps(self, prog, feeds, hyper, steps):
        cmd = self.device.command_buffer()
        try:
            enc = encode(self.device, cmd, prog.rec.commands, timestamps=True)
            try:
                runs = [(label, []) for label in enc.query_labels]
                for _ in range(steps):
                    prog.write_inputs(feeds, hyper)
                    self.device.submit_and_wait(cmd, "profiling a graph step")
                    for (label, times), (_l, seconds) in zip(runs, read_timestamps(self.device, enc)):
                        times.append(seconds)
            finally:
                enc.free()
        finally:
            self.device.free_command_buffer(cmd)
        return runs

    def _profile_wall(self, prog, feeds, hyper, steps):
        groups: list[tuple] = []
        for c in prog.rec.commands:
            if not groups or groups[-1][0] != c.label:
                groups.append((c.label, []))
            groups[-1][1].append(c)
        runs = [(label, []) for label, _ in groups]
        for _ in range(steps):
            prog.write_inputs(feeds, hyper)
            for (label, cmds), (_l, times) in zip(groups, runs):
                cmd = self.device.command_buffer()
                try:
                    enc = encode(self.device, cmd, cmds)
                    try:
                        t0 = time.perf_counter()
                        self.device.submit_and_wait(cmd, "profiling a graph step")
                        times.append(time.perf_counter() - t0)
                    finally:
                        enc.free()
                finally:
                    self.device.free_command_buffer(cmd)
        return runs

    def close(self) -> None:
        for prog in self.programs.values():
            prog.free()
        self.programs.clear()
        for buf in self.leaves.values():
            buf.free()
        self.leaves.clear()
        for _opt, bufs in self.opt_state.values():
            for entries in bufs.values():
                for view in entries.values():
                    view.buffer.free()
        self.opt_state.clear()


def count_dispatches(graph: Graph, plan=None, optimizer=None, grads: bool = True) -> dict:
    """What one graph-path step records, counted by a dry run (no device):
    dispatches per direction, host transfers in and out, and barriers."""
    backward = graph.loss is not None and (grads or optimizer is not None)
    mem = plan_memory(graph, plan, backward=backward)
    leaf = {}

    def make_buffer(nbytes, name):
        return FakeBuffer(nbytes, name)

    def leaf_buffer(pb):
        (key,) = pb.values
        return leaf.setdefault(key, FakeBuffer(pb.nbytes, str(key)))

    on_device = optimizer if optimizer is not None and hasattr(optimizer, "record") else None
    layout = _Layout(graph, mem, make_buffer, leaf_buffer, grads, False, on_device,
                     (FakeBuffer(0, "upload"), FakeBuffer(0, "download")))
    opt_record = None
    if on_device is not None:
        params = {name: BufView(leaf_buffer(_pb_for(mem, ("val", i))), 0, graph.nodes[i].shape, graph.nodes[i].dtype)
                  for name, i in graph.params.items()}
        zeros = {name: np.zeros(v.shape, NUMPY[v.dtype]) for name, v in params.items()}
        state = {p: {k: BufView(FakeBuffer(np.asarray(a).nbytes), 0, np.shape(a),
                                "f16" if np.asarray(a).dtype == np.float16 else "f32")
                     for k, a in entries.items()} for p, entries in on_device.init_state(zeros).items()}
        grads_views = layout.param_grads(make_buffer)

        def opt_record(rec):
            on_device.record(rec, params, grads_views, state, layout.hyper)
    rec = Recorder(None)
    record_step(rec, graph, mem, layout.view, layout.io, opt_record)
    counts = {"forward": 0, "backward": 0, "optimizer": 0, "transfers_in": 0, "transfers_out": 0,
              "fills": 0, "copies": 0}
    for c in rec.commands:
        direction = c.label[1] if c.label else "other"
        kind = type(c).__name__
        if kind == "Dispatch":
            counts[direction] = counts.get(direction, 0) + 1
        elif direction == "transfer":
            counts["transfers_in" if c.label[0] == "feeds" else "transfers_out"] += 1
        else:
            counts["fills" if kind == "Fill" else "copies"] += 1
    counts["dispatches"] = counts["forward"] + counts["backward"] + counts["optimizer"]
    counts["barriers"] = count_barriers(rec.commands)
    counts["submits"] = 1
    counts["scratch_bytes"] = rec.arena.high
    return counts


def _pb_for(mem, key):
    s = mem.slots[key]
    return mem.buffers[s.buffer]


__all__ = ["GraphSession", "count_dispatches", "record_step", "accumulate", "backward_nodes"]
