"""Data-parallel training over MPI (mpi4py): one rank per device.

A run started by a launcher (`mpiexec -n N flowgrad train ...`, `mpirun`, or
`flowgrad train --ranks N`, which starts mpiexec itself: training/mpi_launch.py)
trains on N ranks.
Each rank holds a full replica of the model on its own device (vulkan:<local
rank>, or numpy) and reads its own rows of each global batch: the model's
`batch` is the per-rank batch, the global batch is batch x N, and the
sequence of global batches is the one a single process with the global
batch would read. The gradients are averaged across ranks in
buckets (training/grad_buckets.py), each reduced by a non-blocking Allreduce
posted as soon as its gradients are final, then every rank applies the same
update.
For a loss that is a mean over the batch (as cross_entropy is), the averaged
gradient is the gradient of the global batch: N ranks train like one process
with the global batch, up to float rounding.

The collectives with their timeouts and the per-step protocol are kept
together because each rank must take the same steps in the same order.

Parameters start identical (broadcast from rank 0, which also reads the
checkpoint on resume) and are compared by a checksum every `check_every`
steps. Every collective has a timeout, so a rank that died or hangs ends the
job with an error instead of a hang; an error on one rank aborts all.

mpi4py is an optional extra, imported only in a process a launcher started
(join); nothing else in flowgrad imports it."""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from flowgrad.errors import FlowError
from flowgrad.objectives import ObjectiveCounts
from flowgrad.training import mpi_launch
from flowgrad.training.grad_buckets import DEFAULT_BUCKET_MB, GradBuckets, bucket_count
from flowgrad.training.mpi_launch import INSTALL
from flowgrad.update_counts import Counts

# set by MPICH/Intel MPI (PMI), Open MPI, and PMIx launchers in every process they start
LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")     # the rank count as the launcher set it
TIMEOUT_ENV = "FLOWGRAD_MPI_TIMEOUT"
DEFAULT_TIMEOUT = 120.0               # seconds a collective may wait for the other ranks
BUCKET_ENV = "FLOWGRAD_MPI_BUCKET_MB"   # gradient all-reduce bucket size (MiB)
SPIN = 0.002                          # seconds a collective polls without sleeping


def launched() -> bool:
    """Was this process started by an MPI launcher? (No mpi4py import.)"""
    return any(v in os.environ for v in LAUNCHER_VARS)


def import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise FlowError(f"data-parallel training needs mpi4py and an MPI library ({e})",
                        hint=f"install them with: {INSTALL}") from None
    except RuntimeError as e:   # mpi4py's wheel found no libmpi to load: no mpich wheel, no system MPI
        raise FlowError(f"data-parallel training needs an MPI library, and mpi4py found none: {e}",
                        hint=f"install one with: {INSTALL}; or name one with MPI4PY_LIBMPI") from None
    return MPI


def join(timeout: float | None = None) -> World | None:
    """The World of this run when a launcher started more than one rank, else None."""
    if not launched():
        return None
    MPI = import_mpi()
    comm = MPI.COMM_WORLD
    _check_launcher_matches(MPI, comm.size)
    if comm.size == 1:
        return None
    if timeout is None:
        timeout = _env_number(TIMEOUT_ENV, DEFAULT_TIMEOUT, "a number of seconds")
    return World(MPI, comm, timeout, bucket_bytes())


def describe_ranks(sess, ranks: int) -> None:
    """What sess.explain() says of a step on `ranks` ranks: their count and the
    gradient buckets the all-reduce cuts (one bucket is posted only after the
    whole backward; several overlap it)."""
    sess.ranks = ranks
    sess.grad_buckets = bucket_count(sess.graph, bucket_bytes())


def bucket_bytes() -> int:
    """The gradient all-reduce bucket size that FLOWGRAD_MPI_BUCKET_MB asks for, in bytes."""
    return max(4, int(_env_number(BUCKET_ENV, DEFAULT_BUCKET_MB, "a size in MiB") * (1 << 20)))


def _check_launcher_matches(MPI, size: int) -> None:
    """A launcher of another MPI than the one mpi4py loads starts singletons:
    N processes each training alone, over the same outputs. Its own size
    variable tells."""
    for var in SIZE_VARS:
        text = os.environ.get(var, "")
        if text.isdigit() and int(text) != size:
            library = MPI.Get_library_version().strip("\x00 \n").splitlines()[0].strip()
            raise FlowError(f"this process was started as one of {text} ranks ({var}={text}), but MPI sees "
                            f"{size}: the launcher is not of the MPI library mpi4py loads ({library})",
                            hint="start the ranks with that library's mpiexec (`flowgrad train --ranks N` finds "
                                 "it), or make mpi4py load the launcher's library (the mpi4py wheel: "
                                 "MPI4PY_MPIABI=openmpi or mpich)")


def _env_number(name: str, default: float, what: str) -> float:
    text = os.environ.get(name)
    try:
        value = default if text is None else float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise FlowError(f"{name} must be {what} above 0, got {text!r}")
    return value


class RanksDisagree(FlowError):
    """An error every rank raises together (seen in a collective's result): no abort needed."""


class NoAnswer(FlowError):
    """A collective this rank waited on timed out: another rank failed or hangs."""


class World:
    def __init__(self, MPI, comm, timeout: float, bucket_bytes: int = int(DEFAULT_BUCKET_MB * (1 << 20))):
        self.MPI, self.comm, self.timeout, self.bucket_bytes = MPI, comm, timeout, bucket_bytes
        self.rank, self.size = comm.rank, comm.size
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = local.rank
        local.Free()
        self._buckets: dict[int, GradBuckets] = {}   # by id of the graph (each objective's) they cut
        mpi_launch.record_start(self.rank)     # under `--ranks`: to name this rank if it dies

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def __str__(self) -> str:
        return f"rank {self.rank} of {self.size}"

    # -- devices -------------------------------------------------------------
    def device_for(self, spec: str) -> str:
        """`auto` and `vulkan` become vulkan:<local rank> (among the host's GPUs
        for auto; ranks share devices round-robin when there are fewer);
        cpu and an explicit vulkan:N stay as given."""
        if spec not in ("auto", "vulkan"):
            return spec
        from flowgrad.errors import DeviceError
        from flowgrad.exec_vulkan import runtime

        try:
            devices = runtime.list_devices()
        except DeviceError:
            if spec == "auto":
                return "cpu"
            raise
        gpus = [d.index for d in devices if runtime.first_gpu([d]) is not None]
        pool = gpus if spec == "auto" or gpus else [d.index for d in devices]
        if not pool:
            return "cpu" if spec == "auto" else spec   # "vulkan": select_device says what is missing
        return f"vulkan:{pool[self.local_rank % len(pool)]}"

    # -- collectives, each with a timeout ----------------------------------------
    def _wait(self, requests, what: str) -> None:
        """Poll instead of blocking, so a dead or stuck rank is a timeout, not a
        hang. Each poll also moves the collective on (MPI progresses
        non-blocking calls inside them), so the first SPIN seconds poll
        between yields of the CPU (to a rank still computing on the same
        core); after that, between short sleeps."""
        start = time.monotonic()
        nap = 0.0
        while not self.MPI.Request.Testall(requests):
            waited = time.monotonic() - start
            if waited > self.timeout:
                raise NoAnswer(f"{what} got no answer from the other ranks within {self.timeout:g} s: "
                               "another rank failed or hangs", hint=f"the limit is {TIMEOUT_ENV} (seconds)")
            if waited < SPIN:
                _yield()
            else:
                time.sleep(nap)
                nap = min(1e-3, nap + 1e-5)

    def barrier(self, what: str) -> None:
        self._wait([self.comm.Ibarrier()], what)

    def bcast_bytes(self, data: bytes | None, what: str) -> bytes:
        n = np.array([len(data) if self.is_root else 0], np.int64)
        self._wait([self.comm.Ibcast(n, root=0)], what)
        buf = np.frombuffer(data, np.uint8).copy() if self.is_root else np.empty(int(n[0]), np.uint8)
        self._wait([self.comm.Ibcast(buf, root=0)], what)
        return buf.tobytes()

    def share(self, obj, what: str):
        """Rank 0's JSON-able obj on every rank."""
        import json

        data = json.dumps(obj).encode() if self.is_root else None
        return json.loads(self.bcast_bytes(data, what).decode())

    def allgather(self, array: np.ndarray, what: str) -> np.ndarray:
        """[size, *array.shape]: every rank's array (same shape and dtype on all). Sent as
        bytes: Open MPI has no f16 datatype (mixed precision's eval outputs)."""
        array = np.ascontiguousarray(array)
        data = array.reshape(-1).view(np.uint8)
        out = np.empty((self.size, data.size), np.uint8)
        self._wait([self.comm.Iallgather(data, out)], what)
        return out.view(array.dtype).reshape((self.size,) + array.shape)

    # -- training -------------------------------------------------------------------
    def buckets(self, graph) -> GradBuckets:
        """The gradient buckets of `graph`, ready for a step (laid out once)."""
        buckets = self._buckets.get(id(graph))
        if buckets is None or buckets.graph is not graph:
            buckets = self._buckets[id(graph)] = GradBuckets(graph, self.bucket_bytes)
        buckets.begin(lambda a: self.comm.Iallreduce(self.MPI.IN_PLACE, a, op=self.MPI.SUM))
        return buckets

    def finish(self, buckets: GradBuckets, loss: float, stop: bool, step: int, state=None):
        """(grads averaged across ranks, mean loss, whether any rank was asked
        to stop, `state` averaged across ranks), once every bucket was posted
        (as its gradients became final). The loss, the stop flag and the
        state travel in one small all-reduce beside the buckets."""
        missing = buckets.unposted()
        if missing:
            raise FlowError(f"{self}: the step reported no gradient for {missing[0]}; its bucket was never reduced")
        state = state or {}
        extra = np.concatenate([[loss, float(stop)]] + [v.ravel().astype(np.float64) for v in state.values()])
        reqs = buckets.requests + [self.comm.Iallreduce(self.MPI.IN_PLACE, extra, op=self.MPI.SUM)]
        self._wait(reqs, f"the gradient all-reduce of step {step}")
        means, at = {}, 2
        for name, v in state.items():
            means[name] = (extra[at:at + v.size] / self.size).astype(v.dtype).reshape(v.shape)
            at += v.size
        return buckets.averaged(self.size), float(extra[0] / self.size), bool(extra[1] > 0), means

    def average(self, graph, grads: dict[str, np.ndarray], loss: float, stop: bool, step: int):
        """finish() for gradients already computed (every bucket posted at once)."""
        buckets = self.buckets(graph)
        for name in buckets.order:
            buckets.final(name, grads[name])
        return self.finish(buckets, loss, stop, step)[:3]

    def step(self, sess, feeds, optimizer, stop: bool, step: int) -> tuple[float, bool, dict | None]:
        """One data-parallel step: forward + backward, each gradient bucket's
        all-reduce posted as soon as its gradients are final (during the
        backward on closures; after it on the graph path, whose backward is
        one submit), then the optimizer update alone (on the graph path a
        second submit). With several objectives, each objective's in turn:
        its gradients averaged and its update applied before the next one's
        forward, which reads the params that update left on every rank.
        Returns (mean loss, stop agreed, each objective's mean loss with
        several, else None).

        State the forward updates (batch norm's running statistics, from each
        rank's own rows) is averaged across ranks every step: an average of
        running means over equal shards is the running mean of the global
        batches, as one process keeps it (a running variance's average leaves
        out the spread between the shards' means)."""
        from flowgrad.objectives import per_objective, several

        sess.optimizer = optimizer
        if not several(sess.graph):
            loss, stop = self._objective_step(sess, sess.graph, sess.runner, feeds, optimizer, stop, step)
            return loss, stop, None
        feeds = sess.runner_feeds(feeds, True)   # each objective's forward draws the same noise, as in one process
        losses = {}
        for (name, graph, runner), opt in zip(sess.parts, per_objective(optimizer, sess.graph)):
            losses[name], stop = self._objective_step(sess, graph, runner, feeds, opt, stop, step)
        sess.steps += 1
        return next(iter(losses.values())), stop, losses

    def _objective_step(self, sess, graph, runner, feeds, optimizer, stop: bool, step: int) -> tuple[float, bool]:
        """One objective's step on `runner` (the session's own, with one
        objective): gradients, averaged, then its update."""
        buckets = self.buckets(graph)
        if runner is sess.runner:
            loss = sess.step(feeds, grads=True, on_grad_final=buckets.final, outputs=()).loss
        else:
            _outputs, loss, _grads = runner.step(feeds, grads=True, on_grad_final=buckets.final, outputs=())
        state = sess.graph.states().keys()
        grads, loss, stop, means = self.finish(buckets, float(loss), stop, step,
                                               sess.runner.get_params(sorted(state)) if state else None)
        if means:
            sess.runner.set_params(means)
        runner.apply_update(optimizer, grads)
        return loss, stop

    def sync_from_root(self, runner, scalers=(), start: int = 0) -> int:
        """Every rank takes rank 0's params, optimizer state and counts,
        loss scales (dtype="mixed": each objective's) and the run's step,
        `start` on rank 0 (returned): rank 0 alone read the checkpoint."""
        from safetensors.numpy import load, save

        data = None
        if self.is_root:
            counts, state = runner.get_opt_state()
            tensors = {f"param/{k}": np.ascontiguousarray(v) for k, v in runner.get_params().items()}
            tensors.update({f"optim/{p}/{k}": np.ascontiguousarray(v)
                            for p, st in state.items() for k, v in st.items()})
            tensors["counts"] = np.array([counts.updates, counts.iterations], np.int64)
            # several objectives: each one's (under dtype="mixed" each skips its own updates)
            tensors.update({f"counts/{name}": np.array([c.updates, c.iterations], np.int64)
                            for name, c in getattr(counts, "each", {}).items()})
            tensors["start"] = np.array([start], np.int64)
            data = save(tensors)
        tensors = load(self.bcast_bytes(data, "the broadcast of rank 0's params"))
        counts = Counts(*(int(n) for n in tensors.pop("counts")))
        each = {k[7:]: Counts(*(int(n) for n in tensors.pop(k))) for k in list(tensors) if k.startswith("counts/")}
        if each:
            counts = ObjectiveCounts(counts.updates, counts.iterations, each)
        start = int(tensors.pop("start")[0])
        if not self.is_root:
            params = {k[6:]: v for k, v in tensors.items() if k.startswith("param/")}
            state: dict = {}
            for k, v in tensors.items():
                if k.startswith("optim/"):
                    p, _, name = k[6:].rpartition("/")
                    state.setdefault(p, {})[name] = v
            runner.set_params(params)
            runner.set_opt_state(counts, state)
        if scalers:
            # a rank at another scale overflows where the others do not, and its skip skips every rank's step
            for scaler, state in zip(scalers, self.share([s.state() for s in scalers],
                                                         "the broadcast of rank 0's loss scale")):
                scaler.load_state(state)
        return start

    def check_same_params(self, params: dict[str, np.ndarray], step: int) -> None:
        """A checksum per param (the sum of its bit patterns, exact), gathered;
        a difference is an error on every rank naming the first differing param."""
        names = list(params)
        sums = np.array([_bits_sum(params[n]) for n in names], np.uint64)
        every = self.allgather(sums, f"the param check of step {step}")
        for j, name in enumerate(names):
            differ = [r for r in range(self.size) if every[r, j] != every[0, j]]
            if differ:
                raise RanksDisagree(f"data-parallel ranks diverged at step {step}: param {name} on rank "
                                    f"{differ[0]} differs from rank 0",
                                    hint="every rank must run the same flowgrad, model, config and data")

    def abort(self, error: BaseException) -> None:
        """One rank failed alone: say which (with the traceback of an
        unexpected exception), then end every rank."""
        import traceback

        if not isinstance(error, (FlowError, KeyboardInterrupt)):
            traceback.print_exception(error, file=sys.stderr)
        # the rank that waited in vain is not the one that failed: it says so
        verb = "stopped waiting" if isinstance(error, NoAnswer) else "failed"
        print(f"error: {self} {verb}: {str(error) or type(error).__name__}", file=sys.stderr, flush=True)
        mpi_launch.record_failed(self.rank, waited=isinstance(error, NoAnswer))
        time.sleep(0.5)   # mpiexec forwards output from a pipe: give it the message before Abort kills the ranks
        self.comm.Abort(1)
        # MPICH's Abort can return before its launcher kills this process: going on would print the
        # error again (without the rank) and run the caller's except/finally blocks in a rank meant gone
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os._exit(1)


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


def _bits_sum(arr: np.ndarray) -> int:
    raw = np.ascontiguousarray(arr)
    words = raw.view(np.uint16 if raw.itemsize == 2 else np.uint32)
    return int(words.sum(dtype=np.uint64))


# -- the data each rank reads --------------------------------------------------------------

class Shard:
    """A data source seen by one rank: train_batch gives this rank's rows of
    the global batch; evaluate scores a split over the global eval batches,
    each rank computing its rows' outputs, gathered so every rank scores the
    same full batch (the numbers of one process). Everything else is the
    source's own."""

    def __init__(self, data, world: World):
        self.data, self.world = data, world
        self.local = data.batch
        data.batch = self.local * world.size      # the global batch: order and epochs as one process
        data.check_size()

    def __getattr__(self, name):
        return getattr(self.data, name)

    def rows(self, feeds: dict) -> dict:
        lo = self.world.rank * self.local
        return {k: np.ascontiguousarray(v[lo:lo + self.local]) for k, v in feeds.items()}

    def train_batch(self, step: int) -> dict:
        return self.rows(self.data.train_batch(step))

    def evaluate(self, sess, split: str, metric) -> dict:
        from flowgrad.training import metrics

        return metrics.evaluate(_GatheringSession(sess, self), self.data, split, metric)


class _GatheringSession:
    """What metrics.evaluate sees: a session whose batch is the global batch.
    A short last batch goes to sess.eval_rows, which every rank runs whole."""

    def __init__(self, sess, shard: Shard):
        self._sess, self._shard = sess, shard

    def __getattr__(self, name):
        return getattr(self._sess, name)

    def step(self, feeds, grads: bool = False, **kw):
        rows = self._shard.rows(feeds)
        res = self._sess.step(rows, grads=False)
        world, local = self._shard.world, self._shard.local
        mask = self._shard.data.score_mask(rows)
        weight = local if mask is None else int(np.count_nonzero(mask))
        outs = {k: self._gather(k, v, world, local, weight) for k, v in res.outputs.items()}
        loss = outs.get(self._loss_name)
        return type(res)(outs, {}, None if loss is None else float(loss))

    def _gather(self, name, value, world, local, weight):
        value = np.asarray(value)
        if value.ndim and value.shape[0] == local:
            return world.allgather(value, "the gathering of eval outputs").reshape((-1,) + value.shape[1:])
        if name in self._loss_names:
            # a loss that is a mean over the scored targets (over the rows when all are scored): each
            # rank's mean weighted by its count is the batch's mean, as one process computes it (with
            # padded lines the ranks' counts differ); summed in rank order, every rank gets the same bits
            every = world.allgather(np.array([float(value), weight], np.float64), "the gathering of eval losses")
            total = every[:, 1].sum()
            if not total:
                return np.float64(every[:, 0].mean())
            # a rank with nothing scored has a loss of 0/0: it counts for nothing, as in one process
            return np.float64(np.where(every[:, 1] > 0, every[:, 0] * every[:, 1], 0.0).sum() / total)
        return value

    @property
    def _loss_name(self):
        graph = self._sess.graph
        return next((n for n, i in graph.outputs.items() if i == graph.loss), None)

    @property
    def _loss_names(self) -> set:
        """The loss's output and, with several objectives, each one's loss (each an output)."""
        from flowgrad.objectives import objective_names

        return {self._loss_name, *(n for n in objective_names(self._sess.graph) if n in self._sess.graph.outputs)}
