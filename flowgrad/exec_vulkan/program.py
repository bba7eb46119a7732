"""Recording one step program: feeds in, the step graph's nodes (the forward,
then the backward the autodiff pass appended), read-backs and the optimizer
update, recorded once per mode into one command buffer (StepProgram), over
buffers laid out by the memory plan (StepLayout). The same recording over
fake buffers counts what a step sends to the device without one
(count_dispatches).

The recording never looks at op names: each node's work comes from its op's
forward lowering, recorded inside a section labelled with the node (a
backward node's with the node it differentiates), so profiling and dispatch
counting see the same commands."""
from __future__ import annotations

import contextlib
import weakref

import numpy as np

from flowgrad.dtypes import NUMPY_DTYPE as NUMPY, dtype_of
from flowgrad.errors import FlowError
from flowgrad.exec_vulkan.encoder import encode
from flowgrad.exec_vulkan.limits import ALIGN, align_up
from flowgrad.exec_vulkan import readback
from flowgrad.exec_vulkan.readback import HostBlock, ReadyEvents, signal_groups
from flowgrad.exec_vulkan.submit import Submission, submit_and_wait
from flowgrad.exec_vulkan.upload import FeedWriter
from flowgrad.exec_vulkan.index_checks import UNSET
from flowgrad.exec_vulkan.recorder import (BufView, Dispatch, FakeBuffer, Fill, Mark, Recorder, count_barriers, depends,
                                           touched)
from flowgrad.exec_vulkan.lower import lowering_for
from flowgrad.exec_vulkan.lower.matmul_kernels import SPLIT_TARGET, device_family
from flowgrad.exec_vulkan.multi_tensor import CAST_SLOTS, merge_casts, record_unscale
from flowgrad.exec_vulkan.optim_records import groups_for, slot_groups_for, update_record
from flowgrad.graph import Graph, fill_value
from flowgrad.exec_vulkan.memory import MemoryPlan
from flowgrad.exec_vulkan.step_plan import step_plan

INDEX_FLAGS = "@index-flags"   # the read-back name of the index kernels' flag words

# A weight gradient's product moved beside the next product (memory.beside_next_product) gets a
# mark before it, so that the next product waits only for what came before the mark
SPLIT_BARRIERS = False


class StepIO:
    """Where the host's data enters and leaves one step: regions of an upload
    and a download staging buffer, and the device views they are copied to
    and from."""

    def __init__(self):
        self.uploads: list[tuple[str, BufView, BufView]] = []     # (name, staging, device)
        self.downloads: list[tuple[str, BufView, BufView]] = []   # (name, device, staging)
        self.up_bytes = 0
        self.down_bytes = 0
        self.down_staging = None

    def upload_region(self, staging, shape, dtype) -> BufView:
        view = BufView(staging, self.up_bytes, shape, dtype)
        self.up_bytes = align_up(self.up_bytes + max(view.nbytes, 1), ALIGN)
        return view

    def download_region(self, staging, shape, dtype) -> BufView:
        view = BufView(staging, self.down_bytes, shape, dtype)
        self.down_bytes = align_up(self.down_bytes + max(view.nbytes, 1), ALIGN)
        return view


def record_step(rec: Recorder, graph: Graph, mem: MemoryPlan, view, io: StepIO, optimizer_record=None,
                scale_record=None, fills=()) -> None:
    """Record one step: feeds in, the step graph's nodes (the forward, then
    the backward), the loss scaler's unscale and overflow check, then the
    optimizer update; the read-backs in groups, each right after the last
    command that writes one of its sources. fills: (view, value) of the
    constants the graph holds that are one value throughout."""
    with rec.section("feeds", "transfer"):
        for _name, staging, device_view in io.uploads:
            rec.copy(staging, device_view)
        for dst, value in fills:
            rec.fill_value(dst, value)
    nodes = graph.nodes
    rec.trusted = frozenset(n.id for n in nodes if n.op == "input")   # feeds are range-checked on the host
    for step in mem.schedule:
        node = nodes[step.node]
        ins = [view(("val", i)) for i in node.inputs]
        # a backward node is timed and counted under the node it differentiates
        of = node if node.grad_of is None else nodes[node.grad_of]
        direction = "forward" if of is node else "backward"
        with rec.section(of.label, direction, of.id), _lowering_errors(node, direction):
            at = len(rec.commands)
            lowering_for(node.op).forward(rec, node, ins, view(("val", node.id)))
            if step.beside and SPLIT_BARRIERS and _thin_product(rec, rec.commands[at:]):
                rec.commands.insert(at, Mark(rec.label))
    scaling = []
    if scale_record is not None:
        at = len(rec.commands)
        with rec.section("loss scale", "backward"):
            scale_record(rec)
        scaling = rec.commands[at:]
    if rec.checks.checks:   # the index kernels' flags: reset first, read back with the results
        flags = rec.checks.whole()
        rec.commands.insert(0, Fill(flags, UNSET, ("feeds", "transfer")))
        io.downloads.append((INDEX_FLAGS, flags, io.download_region(io.down_staging, flags.shape, flags.dtype)))
    start = len(rec.commands)
    with rec.section("read-back", "transfer"):
        for _name, device_view, staging in io.downloads:
            rec.copy(device_view, staging)
    # the flag words stay last: after every index kernel, whatever it writes
    early = [c for c in rec.commands[start:] if c.src.buffer is not rec.checks]
    if optimizer_record is not None:
        with rec.section("optimizer", "optimizer"):
            optimizer_record(rec)
    merge_casts(rec, slot_groups_for(CAST_SLOTS))
    # a block's unscale as soon as its gradients are final, and with it their read-back
    hoist(rec.commands, scaling)
    place_after_last_writer(rec.commands, early, readback.GROUP_BYTES)


def _thin_product(rec: Recorder, commands: list) -> bool:
    """`commands` are one tensor-core product whose grid leaves room on the
    device (under a wave of workgroups): worth running beside the next one."""
    if len(commands) != 1 or not isinstance(commands[0], Dispatch) or not commands[0].alone:
        return False
    x, y, z = commands[0].groups
    return x * y * z < SPLIT_TARGET[device_family(rec.caps)]


def hoist(commands: list, movers: list) -> None:
    """Move each of `movers`, in order, to right after the nearest earlier
    command it depends on: the earliest place where it computes the same
    (but for a product run beside the next one, see _past_beside)."""
    for m in movers:
        at = next((i for i, c in enumerate(commands) if c is m), None)
        if at is None:
            continue
        to = at
        while to > 0 and not depends(m, commands[to - 1]):
            to -= 1
        commands.insert(_past_beside(commands, to, at), commands.pop(at))


def _past_beside(commands: list, to: int, at: int) -> int:
    """Where a mover that must follow commands[to - 1] goes: if that is a
    product marked to run beside the next one, after the next one's first
    dispatch too, else that next product would wait for the marked one
    behind the mover's barrier."""
    if to < 2 or not isinstance(commands[to - 2], Mark):
        return to
    nxt = next((j for j in range(to, at) if isinstance(commands[j], Dispatch) and commands[j].alone), None)
    return to if nxt is None else nxt + 1


def _by_final_write(views: list, commands: list) -> list:
    """`views` in the order the commands so far last write them (a batch of
    them is then final as early as its members allow)."""
    last = _last_writes(commands, views)
    return [views[k] for k in sorted(range(len(views)), key=lambda k: last.get(k, -1))]


def place_after_last_writer(commands: list, copies: list, batch_bytes: int = 0) -> None:
    """Move `copies` (read-backs, recorded together after the step's work)
    in batches of at least `batch_bytes`, taken in the order their sources
    become final, each to right after the last earlier command that writes
    bytes one of its copies reads: the same bytes reach the staging buffer,
    and a late layer's gradients are on their way (and on the host, see
    readback.py) while the backward of the earlier layers runs. A copy
    nothing before it writes stays where it is."""
    if not copies:
        return
    start = next(i for i, c in enumerate(commands) if c is copies[0])
    last = {id(copies[k]): i for k, i in _last_writes(commands[:start], [c.src for c in copies]).items()}
    after: dict[int, list] = {}
    batch, size = [], 0
    for c in sorted((c for c in copies if id(c) in last), key=lambda c: last[id(c)]):
        batch.append(c)
        size += c.src.nbytes
        if size >= batch_bytes:
            after.setdefault(last[id(c)], []).extend(batch)
            batch, size = [], 0
    if batch:
        after.setdefault(last[id(batch[-1])], []).extend(batch)
    out = []
    for i, c in enumerate(commands):
        if id(c) not in last:
            out.append(c)
        out += after.get(i, ())
    commands[:] = out


def _last_writes(commands: list, views: list) -> dict[int, int]:
    """{k: index of the last of `commands` that writes bytes of views[k]}."""
    by_buffer: dict[int, list] = {}
    for k, v in enumerate(views):
        by_buffer.setdefault(id(v.buffer), []).append(k)
    last = {}
    for i, cmd in enumerate(commands):
        for buf, lo, hi in touched(cmd)[1]:
            for k in by_buffer.get(id(buf), ()):
                if lo < views[k].offset + views[k].nbytes and views[k].offset < hi:
                    last[k] = i
    return last


@contextlib.contextmanager
def _lowering_errors(node, direction):
    """A lowering that rejects its node (ValueError) becomes a FlowError at the node's source line."""
    try:
        yield
    except ValueError as e:
        raise FlowError(f"{node.label} = {node.op}(...): the Vulkan {direction} lowering cannot run it: {e}",
                        node.span, hint="compile with backward='closures' to run it on closures") from e


class StepLayout:
    """The buffers and I/O of one step program, over real or fake buffers."""

    def __init__(self, step, make_buffer, leaf_buffer, want_grads, grad_inputs, optimizer, staging, scaled=False,
                 outputs=None, plan_buffer=None):
        """step: the StepPlan recorded. scaled: the backward starts from a
        loss scale the host uploads (into the seed leaf: [scale, 1/scale]),
        and the gradients are unscaled and checked for overflow on the device
        (`found`). outputs: the names of the model's outputs read back (None: all).
        plan_buffer(pb): the buffer that holds the memory plan's buffer pb, where
        not make_buffer's own."""
        graph = step.graph
        self.graph, self.mem = graph, step.memory
        mem = self.mem
        self.seed_key = ("val", step.seed) if step.seed is not None else None
        self.grad_keys = {name: ("val", i) for name, i in step.grads.items()}
        self.updated = [name for name in step.grads if name in graph.params]
        self.buffers = []
        for pb in mem.buffers:
            if pb.kind in ("param", "const", "seed"):
                self.buffers.append(leaf_buffer(pb))
            else:
                self.buffers.append(make_buffer(pb.nbytes, f"buffer{pb.index}") if plan_buffer is None
                                    else plan_buffer(pb))
        self.io = StepIO()
        up, down = staging
        self.io.down_staging = down
        # every input node: the user's and those the session feeds itself (the random state)
        for name, i in {n.name: n.id for n in graph.nodes if n.op == "input"}.items():
            if ("val", i) in mem.slots and ("val", i) != self.seed_key:
                node = graph.nodes[i]
                self.io.uploads.append((name, self.io.upload_region(up, node.shape, node.dtype), self.view(("val", i))))
        self.hyper = None
        if optimizer is not None and update_record(optimizer) is not None:
            h = np.asarray(optimizer.hyper(1, 1), np.float32)
            self.hyper = BufView(make_buffer(max(h.nbytes, 4), "hyper"), 0, h.shape, "f32")
            self.io.uploads.append(("@hyper", self.io.upload_region(up, h.shape, "f32"), self.hyper))
        self.scale = self.found = None
        if scaled:
            seed = self.view(self.seed_key)
            self.scale = BufView(seed.buffer, seed.offset, (2,), "f32")
            self.io.uploads.append(("@scale", self.io.upload_region(up, (2,), "f32"), self.scale))
            self.found = BufView(make_buffer(4, "found-inf"), 0, (1,), "f32")
        for name, i in graph.outputs.items():
            if outputs is None or name in outputs:
                self._download(name, ("val", i), down)
        if graph.loss is not None and ("val", graph.loss) in mem.slots:
            self._download("@loss", ("val", graph.loss), down)
        if want_grads:
            for name in graph.params:
                if name in self.grad_keys:
                    self._download(f"@grad:{name}", self.grad_keys[name], down)
            if grad_inputs:
                for name in graph.inputs:
                    if name in self.grad_keys:
                        self._download(f"@grad:{name}", self.grad_keys[name], down)
        if self.found is not None:
            self.io.downloads.append(("@found_inf", self.found, self.io.download_region(down, (1,), "f32")))

    def scaled_grads(self) -> list[BufView]:
        """The gradients a loss-scaled step unscales: every param's and
        input's the backward computes (what is read back or updated), each
        place once (a step graph may hold two equal gradients in one node)."""
        names = list(self.graph.trainable()) + list(self.graph.inputs)
        slots = {n: self.mem.slots[self.grad_keys[n]] for n in names if n in self.grad_keys}
        keys = {(s.buffer, s.offset): self.grad_keys[n] for n, s in slots.items()}
        return [self.view(k) for k in keys.values()]

    def record_unscale(self, rec) -> None:
        """Each gradient times 1/scale, and found = 1 if one overflowed."""
        record_unscale(rec, _by_final_write(self.scaled_grads(), rec.commands), self.scale, self.found, groups_for)

    def _download(self, name, key, staging):
        src = self.view(key)
        self.io.downloads.append((name, src, self.io.download_region(staging, src.shape, src.dtype)))

    def view(self, key) -> BufView:
        s = self.mem.slots[key]
        return BufView(self.buffers[s.buffer], s.offset, s.shape, s.dtype)

    def param_grads(self) -> dict[str, BufView]:
        """The gradient of each param the optimizer updates (the loss reaches it)."""
        return {name: self.view(self.grad_keys[name]) for name in self.updated}


class StepProgram:
    """One recorded step (for one mode) and the device objects it owns."""

    def __init__(self, sess, want_grads: bool, grad_inputs: bool, optimizer, outputs=None):
        """outputs: the model's outputs read back (None: all). Programs of one
        kind of step that read back different outputs share the memory plan's
        buffers (sess.plan_buffers): a step's values live within the step."""
        device, graph = sess.device, sess.graph
        self.device = device
        self.optimizer = optimizer
        backward = want_grads or optimizer is not None
        step = sess.plan.step_for(backward, grad_inputs)
        graph, self.mem = step.graph, step.memory
        owned = []

        def make_buffer(nbytes, _name):
            buf = device.buffer(nbytes, "device")
            owned.append(buf)
            return buf

        shared = sess.plan_buffers(backward, grad_inputs)

        def plan_buffer(pb):
            if pb.index not in shared:
                shared[pb.index] = device.buffer(pb.nbytes, "device")
            return shared[pb.index]

        consts = {}   # the step's own constants (its backward's), uploaded with the program

        def leaf_buffer(pb):
            (key,) = pb.values
            if key[0] == "val" and graph.nodes[key[1]].op == "const" and not sess.holds(graph.nodes[key[1]]):
                node = graph.nodes[key[1]]
                consts[key] = (make_buffer(max(node.type.nbytes, 4), "const"), node)
                return consts[key][0]
            return sess.leaf_buffer(pb)

        up, down = LazyStaging(device, "upload"), LazyStaging(device, "download")
        scaled = backward and getattr(sess, "scaler", None) is not None
        self.layout = StepLayout(step, make_buffer, leaf_buffer, want_grads, grad_inputs, optimizer, (up, down),
                                 scaled, outputs, plan_buffer)
        # a constant of one value is filled in by the step (no transfer of its own), any other uploaded once
        fills, uploads = [], []
        for buf, node in consts.values():
            view, value = BufView(buf, 0, node.shape, node.dtype), node.attrs["value"]
            one = fill_value(value)
            if one is not None:
                fills.append((view, one))
            else:
                uploads.append((view, value))
        sess.write_consts(uploads)
        self.owned = owned
        opt_record = None
        if optimizer is not None and update_record(optimizer) is not None:
            grads = self.layout.param_grads()
            state = sess.optimizer_state_views(optimizer)
            params = {name: sess.param_view(name) for name in grads}
            hyper = self.layout.hyper
            skip = self.layout.found

            record = update_record(optimizer)

            def opt_record(rec):
                record(rec, params, grads, state, hyper, skip)
        self.rec = Recorder(device)
        record_step(self.rec, graph, self.mem, self.layout.view, self.layout.io, opt_record,
                    self.layout.record_unscale if scaled else None, fills)
        self.dispatches = self.rec.counts()["dispatches"]
        self.staging_up = up.materialize(self.layout.io.up_bytes)
        self.staging_down = down.materialize(self.layout.io.down_bytes)
        self.owned += [b for b in (self.staging_up, self.staging_down) if b is not None]
        io = self.layout.io
        self.feeds_in = FeedWriter(self.staging_up, io.uploads)
        self.events = ReadyEvents()
        groups = signal_groups(self.rec.commands, down, self.events)
        self.host = HostBlock(io.down_bytes, io.downloads, groups)   # where read-backs land
        self.traffic = (self.dispatches, len(io.uploads), len(io.downloads))
        self.rec.arena.materialize(device)
        self.rec.checks.materialize(device)
        self.events.materialize(device, len(groups))
        self.graph = graph
        step_part, update_part = split_update(self.rec)
        self.cmd = device.command_buffer()
        self.enc = encode(device, self.cmd, step_part)
        self.submission = Submission(self.cmd)
        self.update_cmd = self.update_enc = self.update_submission = None
        if update_part:
            self.update_cmd = device.command_buffer()
            self.update_enc = encode(device, self.update_cmd, update_part)
            self.update_submission = Submission(self.update_cmd)
        self._finalizer = weakref.finalize(self, free_program, device, self.cmd, self.enc, owned, self.rec.arena,
                                           self.rec.checks, self.update_cmd, self.update_enc, self.events)
        self._finalizer.atexit = False

    def write_inputs(self, feeds: dict, hyper) -> None:
        self.feeds_in.write(feeds, hyper)

    def run(self, feeds, hyper=None) -> dict[str, np.ndarray]:
        (got,) = run_together(self.device, [(self, feeds, hyper)], self.submission)
        if self.update_submission is not None:
            submit_and_wait(self.device, self.update_submission, "running a graph step's optimizer update")
        return got

    def free(self) -> None:
        self._finalizer()


def run_together(device, runs: list[tuple], submission: Submission) -> list[dict[str, np.ndarray]]:
    """runs: [(program, feeds, hyper)], whose command buffers `submission`
    holds in that order: each one's inputs written, one submit and fence
    wait, then each one's read-back ({name: array}), its index flags checked
    in turn. The read-backs are copied as their groups are ready."""
    stats = device.stats
    readings = []
    for prog, feeds, hyper in runs:
        dispatches, uploads, downloads = prog.traffic
        stats["dispatches"] += dispatches
        stats["uploads"] += uploads
        stats["downloads"] += downloads
        prog.feeds_in.write(feeds, hyper)
        readings.append(prog.host.start(prog.staging_down.array if prog.staging_down is not None else None))
        if prog.events.handles:
            prog.events.reset()
    polled = [(reading, prog.events.is_set) for reading, (prog, _f, _h) in zip(readings, runs)
              if prog.events.handles]
    poll = None
    if polled:
        poll = lambda: any([reading.poll(ready) for reading, ready in polled])   # noqa: E731 (each polled)
    submit_and_wait(device, submission, "running a graph step", poll)
    out = []
    for reading, (prog, _feeds, _hyper) in zip(readings, runs):
        stats["reads_before_fence"] += reading.done
        got = reading.finish()
        if INDEX_FLAGS in got:
            prog.rec.checks.raise_flagged(got.pop(INDEX_FLAGS), prog.graph)
        out.append(got)
    return out


def split_update(rec: Recorder) -> tuple[list, list]:
    """(the step's commands, the optimizer update's): the update is a
    submission of its own only where index kernels flag, so that a step whose
    flags the host finds set raises before anything updates the params.
    Elsewhere the whole step is one submission."""
    commands = rec.commands
    if not rec.checks.checks:
        return commands, []
    k = next((i for i, c in enumerate(commands) if c.label == ("optimizer", "optimizer")), len(commands))
    return commands[:k], commands[k:]


def free_program(device, cmd, enc, owned, arena, checks=None, update_cmd=None, update_enc=None, events=None):
    if device.handle is None:
        return
    if events is not None:
        events.free()
    device.free_command_buffer(cmd)
    enc.free()
    if update_cmd is not None:
        device.free_command_buffer(update_cmd)
        update_enc.free()
    for buf in owned:
        buf.free()
    arena.free()
    if checks is not None:
        checks.free()


class LazyStaging:
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


def count_dispatches(graph: Graph, plan=None, optimizer=None, grads: bool = True) -> dict:
    """What one graph-path step records, counted by a dry run (no device):
    dispatches per direction, host transfers in and out, and barriers."""
    backward = graph.loss is not None and (grads or optimizer is not None)
    step = plan.step_for(backward) if plan is not None else step_plan(graph, backward)
    graph, mem = step.graph, step.memory
    leaf = {}

    def make_buffer(nbytes, name):
        return FakeBuffer(nbytes, name)

    def leaf_buffer(pb):
        (key,) = pb.values
        return leaf.setdefault(key, FakeBuffer(pb.nbytes, str(key)))

    on_device = optimizer if optimizer is not None and update_record(optimizer) is not None else None
    scaled = backward and plan is not None and plan.dtype == "mixed"
    layout = StepLayout(step, make_buffer, leaf_buffer, grads, False, on_device,
                        (FakeBuffer(0, "upload"), FakeBuffer(0, "download")), scaled)
    opt_record = None
    if on_device is not None:
        grads_views = layout.param_grads()
        params = {name: BufView(leaf_buffer(_pb_for(mem, ("val", i))), 0, graph.nodes[i].shape, graph.nodes[i].dtype)
                  for name, i in graph.trainable().items() if name in grads_views}
        zeros = {name: np.zeros(v.shape, NUMPY[v.dtype]) for name, v in params.items()}
        state = {p: {k: BufView(FakeBuffer(np.asarray(a).nbytes), 0, np.shape(a),
                                dtype_of(np.asarray(a), narrow=True))
                     for k, a in entries.items()} for p, entries in on_device.init_state(zeros).items()}

        record = update_record(on_device)

        def opt_record(rec):
            record(rec, params, grads_views, state, layout.hyper, layout.found)
    # the kernels the plan's device runs: a tile table, a split-K count or an activation the
    # GEMM's store declines (NVIDIA) changes how many dispatches a step takes
    rec = Recorder(None, info=plan.device if plan is not None else None)
    record_step(rec, graph, mem, layout.view, layout.io, opt_record, layout.record_unscale if scaled else None)
    counts = {"forward": 0, "backward": 0, "optimizer": 0, "transfers_in": 0, "transfers_out": 0,
              "fills": 0, "copies": 0}
    kernels: dict = {}   # node id -> {"forward": [shader, ...], "backward": [...]}, in dispatch order
    for c in rec.commands:
        direction = c.label[1] if c.label else "other"
        kind = type(c).__name__
        if kind == "Mark":
            continue
        if kind == "Dispatch":
            counts[direction] = counts.get(direction, 0) + 1
            if len(c.label) > 2:
                shaders = kernels.setdefault(c.label[2], {"forward": [], "backward": []})[direction]
                if c.shader not in shaders:
                    shaders.append(c.shader)
        elif direction == "transfer" and kind == "Copy":
            counts["transfers_in" if c.label[0] == "feeds" else "transfers_out"] += 1
        else:
            counts["fills" if kind == "Fill" else "copies"] += 1
    counts["dispatches"] = counts["forward"] + counts["backward"] + counts["optimizer"]
    counts["barriers"] = count_barriers(rec.commands)
    counts["submits"] = 2 if split_update(rec)[1] else 1
    counts["scratch_bytes"] = rec.arena.scratch_bytes
    counts["kept_bytes"] = rec.arena.lasting.high   # what kernels keep across the step (rec.keep, counters)
    counts["kernels"] = kernels
    return counts


def _pb_for(mem, key):
    s = mem.slots[key]
    return mem.buffers[s.buffer]

