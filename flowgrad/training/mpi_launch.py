"""Starting ranks on this host: the MPI launcher that matches the MPI library
mpi4py loads, and `flowgrad train --ranks N`, which runs mpiexec itself,
passes Ctrl-C to the ranks and names a rank that died or hangs.

An mpiexec of one MPI cannot start the ranks of another (MPICH's starts
singletons of Open MPI, or they hang), and a machine can hold several (the
mpich wheel beside the Python, the system's Open MPI on PATH), so the
launcher is chosen by asking mpi4py which library it loads.

Nothing here imports mpi4py: the launching process never initializes MPI
(the library is asked in a subprocess)."""
from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import threading

from flowgrad.errors import FlowError

INSTALL = "pip install 'flowgrad[mpi]'   (mpi4py and the mpich wheel, which brings mpiexec)"
RANK_DIR_ENV = "FLOWGRAD_RANK_DIR"    # set by `--ranks`: each rank records its pid and its end there
MPICH, OPEN_MPI = "MPICH", "Open MPI"
# what `Get_library_version()` / `mpiexec --version` print, per family of compatible launchers
LIBRARY_MARKS = {OPEN_MPI: ("Open MPI",), MPICH: ("MPICH", "Intel(R) MPI", "MVAPICH")}
LAUNCHER_MARKS = {OPEN_MPI: ("Open MPI", "OpenRTE", "Open RTE"), MPICH: ("HYDRA", "Intel(R) MPI")}
LAUNCHER_NAMES = ("mpiexec", "mpirun", "mpiexec.hydra", "mpiexec.mpich", "mpirun.mpich",
                  "mpiexec.openmpi", "mpirun.openmpi")
# mpi4py.MPI loaded without MPI_Init: the version string and the shared library's path
_ASK = ("import json, mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False\n"
        "from mpi4py import MPI\n"
        "try:\n    maps = open('/proc/self/maps').read().split()\nexcept OSError:\n    maps = []\n"
        "lib = next((w for w in maps if '/libmpi.' in w or '/libmpi_' in w), None)\n"
        "print(json.dumps([MPI.Get_library_version(), lib]))")


def family(text: str, marks: dict) -> str | None:
    return next((name for name, words in marks.items() if any(w in text for w in words)), None)


def mpi_library(python: str | None = None, env: dict | None = None) -> tuple[str | None, str, str | None]:
    """(family, version line, library path) of the MPI that mpi4py loads in `python` under `env`."""
    python = python or sys.executable
    try:
        proc = subprocess.run([python, "-c", _ASK], capture_output=True, text=True, timeout=60,
                              env=os.environ if env is None else env)
    except (OSError, subprocess.SubprocessError) as e:
        raise FlowError(f"cannot ask {python} which MPI library mpi4py loads: {e}") from None
    if proc.returncode != 0:
        if "No module named 'mpi4py'" in proc.stderr:
            raise FlowError("--ranks needs mpi4py and an MPI library", hint=f"install them with: {INSTALL}")
        raise FlowError(f"mpi4py in {python} cannot load an MPI library:\n{proc.stderr.strip()[-1500:]}",
                        hint=f"install one with: {INSTALL}")
    version, lib = json.loads(proc.stdout.strip().splitlines()[-1])
    text = version.replace("\x00", "").strip()      # Open MPI's string ends in a NUL
    first = text.splitlines()[0].strip() if text else "an unknown MPI"
    return family(version, LIBRARY_MARKS), first, lib


def launcher_family(exe: str) -> str | None:
    try:
        proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return family(proc.stdout + proc.stderr, LAUNCHER_MARKS)


def candidates(python: str, lib: str | None, path: str | None = None) -> list[str]:
    """Launchers to try, in order: the bin/ beside the library's lib/ (its own
    installation), beside the Python (where the mpich wheel puts it), on PATH."""
    dirs = []
    if lib:
        dirs += [os.path.join(os.path.dirname(os.path.dirname(p)), "bin") for p in (lib, os.path.realpath(lib))]
    dirs.append(os.path.dirname(python))
    # every PATH directory, not only the first hit: the mpich wheel's bin/ often comes first
    dirs += [d for d in (os.environ.get("PATH", os.defpath) if path is None else path).split(os.pathsep) if d]
    found, seen = [], set()
    for exe in (os.path.join(d, n) for d in dirs for n in LAUNCHER_NAMES):
        if os.access(exe, os.X_OK) and os.path.isfile(exe):
            real = os.path.realpath(exe)
            if real not in seen:
                seen.add(real)
                found.append(exe)
    return found


def mpiexec_command(ranks: int, python: str | None = None, env: dict | None = None) -> list[str]:
    """`mpiexec -n N ...` with the launcher of the MPI that mpi4py loads in
    `python` (default this one) under `env`, and the options that family
    needs to start N ranks on this host."""
    if ranks < 1:
        raise FlowError(f"--ranks must be at least 1, got {ranks}")
    python = python or sys.executable
    fam, version, lib = mpi_library(python, env)
    tried = []
    for exe in candidates(python, lib, (env if env is not None else os.environ).get("PATH")):
        got = launcher_family(exe)
        if fam is None or got == fam:
            return [exe, "-n", str(ranks)] + launcher_options(got)
        tried.append(f"{exe} ({got or 'an unknown launcher'})")
    want = f"{fam} launcher" if fam else "launcher"
    hint = (f"install Open MPI's launcher (Debian: apt install openmpi-bin), or use MPICH: {INSTALL}"
            if fam == OPEN_MPI else f"install one with: {INSTALL}")
    raise FlowError(f"mpi4py uses {version}, but no {want} (mpiexec) was found"
                    + (f"; found only: {', '.join(tried)}" if tried else ""), hint=hint)


def launcher_options(fam: str | None) -> list[str]:
    if fam != OPEN_MPI:
        return []
    # Open MPI counts one slot per physical core and refuses more ranks, and refuses root; --ranks N
    # asks for N ranks on this host whatever its cores (MPICH asks neither)
    opts = ["--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        opts.append("--allow-run-as-root")
    return opts


def rank_env(ranks: int, threads: int | None = None) -> dict:
    """The environment for `ranks` ranks on this host: numpy's BLAS threads
    (unless set) `threads` per rank, default the cores split between the ranks."""
    threads = str(threads or max(1, (os.cpu_count() or 1) // ranks))
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, threads)
    return env


def strip_ranks(argv: list[str]) -> list[str]:
    """argv without its --ranks N (or --ranks=N)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--ranks":
            skip = True
        elif not a.startswith("--ranks="):
            out.append(a)
    return out


# -- what each rank records (in the directory `--ranks` names) --------------------------

def record_start(rank: int) -> None:
    """<dir>/<pid> holds the rank; `ended` or `failed` is added when it ends
    by itself, `waited` when it gave up waiting for another rank, so a rank
    with no end died from outside, hung, or was stopped."""
    directory = os.environ.get(RANK_DIR_ENV)
    if directory:
        _write(directory, f"{rank}")
        atexit.register(_record_end, directory, rank)


def record_failed(rank: int, waited: bool = False) -> None:
    """`waited`: the rank failed only because another did not answer."""
    directory = os.environ.get(RANK_DIR_ENV)
    if directory:
        _ended[rank] = end = "waited" if waited else "failed"
        _write(directory, f"{rank} {end}")


_ended: dict[int, str] = {}     # how this process's rank ended, once known


def _record_end(directory: str, rank: int) -> None:
    if _ended.setdefault(rank, "ended") == "ended":     # a failure recorded stays
        _write(directory, f"{rank} ended")


def _write(directory: str, text: str) -> None:
    try:
        with open(os.path.join(directory, str(os.getpid())), "w") as f:
            f.write(text)
    except OSError:
        pass  # only used to name a rank that dies; training does not need it


def read_records(directory: str) -> dict[int, tuple[int, str]]:
    """pid -> (rank, how it ended: '' while running or when it died)."""
    out = {}
    for name in os.listdir(directory):
        try:
            with open(os.path.join(directory, name)) as f:
                rank, _, end = f.read().strip().partition(" ")
            out[int(name)] = (int(rank), end)
        except (OSError, ValueError):
            continue
    return out


# -- `--ranks N` ---------------------------------------------------------------------------

def launch(ranks: int, argv: list[str]) -> int:
    """Run `python -m flowgrad.cli *argv` on `ranks` ranks of this host; returns
    the exit status (130 after Ctrl-C, 143 after SIGTERM). mpiexec runs in its
    own process group, so a terminal's Ctrl-C reaches this process alone, which
    passes it to each rank: the ranks finish the same step and save (Open MPI's
    mpiexec would kill them; MPICH's would pass it on a second time, which
    interrupts at once). SIGTERM to this process is passed on alike."""
    import tempfile

    cmd = mpiexec_command(ranks) + [sys.executable, "-m", "flowgrad.cli", *argv]
    with tempfile.TemporaryDirectory(prefix="flowgrad-ranks-") as tmp:
        records = os.environ.get(RANK_DIR_ENV) or tmp     # a caller's directory, to find the ranks' pids
        proc = _start(cmd, {**rank_env(ranks), RANK_DIR_ENV: records})
        exits = _ExitOrder(records, ranks)
        streams = [_Forward(proc.stdout, sys.stdout), _Forward(proc.stderr, sys.stderr)]
        for t in [exits, *streams]:
            t.start()
        rc, passed = _wait(proc, records)
        for t in streams:
            t.join()
        exits.stop()
        ends = read_records(records)
        dead = died_first(exits.order, ends, "".join(s.tail for s in streams))
        silent = did_not_answer(ends)
    if rc != 0 and dead:
        print(f"error: {_ranks(dead)} of {ranks} ended abnormally (killed or crashed); "
              f"{os.path.basename(cmd[0])} stopped the other ranks (exit status {rc})", file=sys.stderr, flush=True)
    elif rc != 0 and silent:
        print(f"error: {_ranks(silent)} of {ranks} {_no_answer(len(silent))}", file=sys.stderr, flush=True)
    return 128 + passed if passed and rc != 0 else rc


def _ranks(named: list[tuple[int, int]]) -> str:
    return ", ".join(f"rank {r} (pid {p})" for r, p in named)


def _no_answer(count: int) -> str:
    """(How long they waited is in each waiting rank's own error.)"""
    it, they = ("it", "it hangs, or is") if count == 1 else ("them", "they hang, or are")
    return f"did not answer: the other ranks stopped waiting for {it} ({they} stuck in a device call)"


def _start(cmd: list[str], env: dict) -> subprocess.Popen:
    try:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, process_group=0, preexec_fn=_ends_with_parent())
    except OSError as e:
        raise FlowError(f"cannot start {cmd[0]}: {e.strerror or e}") from None


def _ends_with_parent():
    """In its own process group mpiexec no longer gets the terminal's signals:
    on Linux it is sent SIGTERM (which ends its ranks) when this process dies."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG


def _wait(proc: subprocess.Popen, records: str) -> tuple[int, int | None]:
    """(mpiexec's exit status, the last stop signal passed to the ranks, if any)."""
    passed: list[int] = []

    def on_term(signum, frame):
        # SIGTERM (kill, docker stop, a scheduler) reaches this process alone: dying of it
        # would leave mpiexec (sent SIGTERM on our death) to kill the ranks before they save
        passed.append(signum)
        pass_signal(proc, records, signum)

    old = (signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread()
           else None)
    try:
        while True:
            try:
                return proc.wait(), (passed[-1] if passed else None)
            except KeyboardInterrupt:
                passed.append(signal.SIGINT)
                pass_signal(proc, records, signal.SIGINT)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def pass_signal(proc: subprocess.Popen, records: str, signum: int) -> None:
    """SIGINT or SIGTERM to each running rank (a second one interrupts its step
    at once); before any rank has recorded its pid, to mpiexec, which ends the job."""
    running = [pid for pid, (_, end) in read_records(records).items() if not end]
    for pid in running:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    if not running and proc.poll() is None:
        proc.send_signal(signum)


class _Forward(threading.Thread):
    """Copies a stream of mpiexec's to ours as it comes (a progress bar's \\r
    included), keeping its end to find the launcher's report of a dead rank."""

    def __init__(self, src, dst):
        super().__init__(daemon=True)
        self.src, self.dst, self.tail = src, dst, ""

    def run(self) -> None:
        import codecs

        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        fd = self.src.fileno()
        while chunk := os.read(fd, 65536):
            text = decode(chunk)
            self.tail = (self.tail + text)[-20000:]
            try:
                self.dst.write(text)
                self.dst.flush()
            except (OSError, ValueError):
                pass
        self.src.close()


class _ExitOrder(threading.Thread):
    """The order in which the ranks' processes end (a pidfd per rank, Linux):
    the first to end without finishing by itself is the one that died; the
    launcher's own report can name the wrong one. epoll queues each pidfd as
    its process ends, so the order holds even when this thread wakes only
    after the launcher has killed the rest."""

    def __init__(self, directory: str, ranks: int):
        super().__init__(daemon=True)
        self.directory, self.ranks = directory, ranks
        self.order: list[int] = []      # pids, first to end first
        self._done = threading.Event()

    def stop(self) -> None:
        self._done.set()
        self.join()

    def run(self) -> None:
        import select

        if not hasattr(os, "pidfd_open"):
            return
        fds, known = {}, set()
        with select.epoll() as ready:
            try:
                while not self._done.is_set():
                    if len(known) < self.ranks:
                        for pid in set(read_records(self.directory)) - known:
                            known.add(pid)
                            try:
                                fd = os.pidfd_open(pid)
                            except OSError:      # already ended
                                self.order.append(pid)
                                continue
                            fds[fd] = pid
                            ready.register(fd, select.EPOLLIN)
                    for fd, _ in ready.poll(0.02):
                        self.order.append(fds.pop(fd))
                        ready.unregister(fd)
                        os.close(fd)
            finally:
                for fd in fds:
                    os.close(fd)


def died_first(order: list[int], records: dict, report: str) -> list[tuple[int, int]]:
    """[(rank, pid)] of the rank whose end ended the job without finishing by
    itself; [] when the first rank to end ended by itself (its own error, or
    Ctrl-C: the rest were stopped after it). With no exit seen (no pidfd),
    Open MPI's report names the rank; MPICH's names a pid that may be wrong.
    [] when a rank failed or gave up waiting (did_not_answer): its Abort has
    mpiexec kill the others in no set order, maybe before it ends itself."""
    if any(end in ("failed", "waited") for _, end in records.values()):
        return []
    for pid in order:
        if pid in records:
            rank, end = records[pid]
            return [] if end else [(rank, pid)]
    named_ranks = {int(r) for r in re.findall(r"process rank (\d+) with PID \d+ on node \S+ exited on signal",
                                              report)}
    by_rank = {rank: pid for pid, (rank, end) in records.items() if not end}
    return sorted((r, by_rank[r]) for r in named_ranks if r in by_rank)


def did_not_answer(records: dict) -> list[tuple[int, int]]:
    """[(rank, pid)] of the ranks the others gave up waiting for: those with
    no end of their own (hung or stopped), when a rank waited and none failed
    by itself (it said why, and the rest waited for it). A rank more than
    abort's half second behind the first to give up is killed before its own
    timeout, so it is named too."""
    ends = [end for _, end in records.values()]
    if "waited" not in ends or "failed" in ends:
        return []
    return sorted((rank, pid) for pid, (rank, end) in records.items() if not end)
