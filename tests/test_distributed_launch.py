"""Starting ranks: the launcher chosen to match the MPI library mpi4py loads,
naming the rank that died, and `flowgrad bench --ranks`."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mpi_flavours
from conftest import env_with_path
from flowgrad.errors import FlowError
from flowgrad.training import distributed, mpi_launch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=mpi_flavours.FAMILIES, ids=["mpich", "openmpi"])
def mpi(request) -> mpi_flavours.Flavour:
    return mpi_flavours.flavour_or_skip(request.param)


def test_the_launcher_is_of_the_library_mpi4py_loads(mpi):
    cmd = mpi.mpiexec(3)
    assert mpi_launch.launcher_family(cmd[0]) == mpi.family
    assert cmd[1:3] == ["-n", "3"]
    # Open MPI needs leave to start more ranks than cores, and to run as root; MPICH takes neither
    assert ("--oversubscribe" in cmd) == (mpi.family == mpi_launch.OPEN_MPI)


def fake_launcher(directory: Path, name: str, version: str) -> Path:
    exe = directory / name
    exe.write_text(f"#!/bin/sh\necho '{version}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_no_matching_launcher_is_an_error_naming_both(tmp_path, monkeypatch):
    """mpi4py loads Open MPI; the only mpiexec, beside the Python and on PATH, is MPICH's."""
    hydra = fake_launcher(tmp_path, "mpiexec", "HYDRA build details:\n    Version: 5.0.2")
    monkeypatch.setattr(mpi_launch, "mpi_library", lambda python, env: (mpi_launch.OPEN_MPI, "Open MPI v4.1.4", None))
    with pytest.raises(FlowError) as e:
        mpi_launch.mpiexec_command(2, str(tmp_path / "python"), {"PATH": str(tmp_path)})
    assert f"mpi4py uses Open MPI v4.1.4, but no Open MPI launcher (mpiexec) was found; found only: {hydra} (MPICH)" \
        in str(e.value)
    assert "apt install openmpi-bin" in e.value.hint
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FlowError, match=r"mpi4py uses Open MPI v4.1.4, but no Open MPI launcher \(mpiexec\) was "
                                        r"found\n  hint:"):
        mpi_launch.mpiexec_command(2, str(empty / "python"), {"PATH": str(empty)})
    # the matching one of the same name in a later PATH directory is taken
    other = tmp_path / "bin"
    other.mkdir()
    orte = fake_launcher(other, "mpiexec", "mpiexec (Open MPI) 5.0.3")
    cmd = mpi_launch.mpiexec_command(2, str(tmp_path / "python"), {"PATH": f"{tmp_path}:{other}"})
    assert cmd[:4] == [str(orte), "-n", "2", "--oversubscribe"]


def test_the_launcher_of_the_librarys_own_installation_comes_first(tmp_path, monkeypatch):
    prefix = tmp_path / "mpich"
    (prefix / "bin").mkdir(parents=True)
    own = fake_launcher(prefix / "bin", "mpiexec", "HYDRA build details:")
    fake_launcher(tmp_path, "mpiexec", "HYDRA build details:")
    lib = str(prefix / "lib" / "libmpi.so.12")
    monkeypatch.setattr(mpi_launch, "mpi_library", lambda python, env: (mpi_launch.MPICH, "MPICH Version: 4.2", lib))
    assert mpi_launch.mpiexec_command(2, str(tmp_path / "python"), {"PATH": str(tmp_path)})[0] == str(own)


def test_a_library_of_no_known_family_takes_the_first_launcher(tmp_path, monkeypatch):
    first = fake_launcher(tmp_path, "mpiexec", "some MPI 1.0")
    monkeypatch.setattr(mpi_launch, "mpi_library", lambda python, env: (None, "some MPI 1.0", None))
    assert mpi_launch.mpiexec_command(2, str(tmp_path / "python"), {"PATH": str(tmp_path)}) == [str(first), "-n", "2"]


def test_families_of_what_libraries_and_launchers_print():
    assert mpi_launch.family("MPICH Version:      5.0.2", mpi_launch.LIBRARY_MARKS) == mpi_launch.MPICH
    assert mpi_launch.family("Intel(R) MPI Library 2021.11", mpi_launch.LIBRARY_MARKS) == mpi_launch.MPICH
    assert mpi_launch.family("Open MPI v4.1.4, package: Debian", mpi_launch.LIBRARY_MARKS) == mpi_launch.OPEN_MPI
    assert mpi_launch.family("mpiexec (OpenRTE) 4.1.4", mpi_launch.LAUNCHER_MARKS) == mpi_launch.OPEN_MPI
    assert mpi_launch.family("HYDRA build details:", mpi_launch.LAUNCHER_MARKS) == mpi_launch.MPICH
    assert mpi_launch.family("MS-MPI", mpi_launch.LAUNCHER_MARKS) is None


def test_the_rank_that_ended_first_without_finishing_is_named():
    records = {100: (0, ""), 101: (1, ""), 102: (2, "")}
    assert mpi_launch.died_first([101, 100, 102], records, "") == [(1, 101)]
    assert mpi_launch.died_first([999, 102, 101], records, "") == [(2, 102)]      # a pid of no rank
    # the first to end ended by itself (an error it reported, or Ctrl-C): the rest were stopped after it
    assert mpi_launch.died_first([100, 101, 102], {**records, 100: (0, "ended")}, "") == []
    assert mpi_launch.died_first([100, 101], {**records, 100: (0, "failed")}, "") == []
    # after the Abort of a rank that failed, mpiexec may kill another before it
    assert mpi_launch.died_first([101, 100], {**records, 100: (0, "failed")}, "") == []
    # no exit seen (no pidfd): Open MPI's report alone; MPICH's pid is not trusted
    report = "mpiexec noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed)."
    assert mpi_launch.died_first([], records, report) == [(1, 101)]
    assert mpi_launch.died_first([], records, "=   PID 102 RUNNING AT vm") == []
    assert mpi_launch.died_first([], records, "") == []


def test_the_ranks_that_others_stopped_waiting_for_are_named():
    records = {100: (0, "waited"), 101: (1, ""), 102: (2, "waited")}
    assert mpi_launch.did_not_answer(records) == [(1, 101)]
    # whatever the order: after the Abort of a rank that waited, mpiexec may kill the hung one first
    assert mpi_launch.died_first([101, 100, 102], records, "") == []
    # every rank with no end of its own, hung or stopped
    assert mpi_launch.did_not_answer({**records, 102: (2, "")}) == [(1, 101), (2, 102)]
    # a rank failed by itself: it said why, the others waited for it
    assert mpi_launch.did_not_answer({**records, 102: (2, "failed")}) == []
    # nobody waited: a rank that died (died_first), a run that ended, or was stopped
    assert mpi_launch.did_not_answer({100: (0, "ended"), 101: (1, "")}) == []
    assert mpi_launch.did_not_answer({100: (0, ""), 101: (1, "")}) == []


# A rank in the fake mpiexec below: records its pid, then `hang` sleeps; `waited` and `failed` record that
# end, then wait to be killed, as after MPI's Abort
FAKE_RANK = """
import sys, time
from flowgrad.training import mpi_launch
rank, how = int(sys.argv[1]), sys.argv[2]
mpi_launch.record_start(rank)
if how != "hang":
    time.sleep(0.5)
    mpi_launch.record_failed(rank, waited=how == "waited")
time.sleep(60)
"""
# mpiexec in the launcher's place: a rank per word before `--`; once one records its end (its Abort), it
# kills the rest, those with no end first (as MPICH's may: the hung rank ends before the one that waited)
FAKE_MPIEXEC = """
import os, subprocess, sys, time
from flowgrad.training import mpi_launch
hows = sys.argv[2:sys.argv.index("--")]
procs = [subprocess.Popen([sys.executable, "-c", sys.argv[1], str(r), how]) for r, how in enumerate(hows)]
directory, deadline = os.environ[mpi_launch.RANK_DIR_ENV], time.monotonic() + 30
while not any(end for _, end in mpi_launch.read_records(directory).values()) and time.monotonic() < deadline:
    time.sleep(0.01)
ends = {pid: end for pid, (_, end) in mpi_launch.read_records(directory).items()}
for p in sorted(procs, key=lambda p: bool(ends.get(p.pid))):
    p.kill()
    p.wait()
sys.exit(1)
"""


@pytest.mark.parametrize("hows,named", [
    (["waited", "hang"], "rank 1 (pid {1}) of 2 did not answer: the other ranks stopped waiting for it "
                         "(it hangs, or is stuck in a device call)"),
    (["hang", "waited", "hang"], "rank 0 (pid {0}), rank 2 (pid {2}) of 3 did not answer: the other ranks stopped "
                                 "waiting for them (they hang, or are stuck in a device call)"),
    (["failed", "hang"], None)])
def test_the_launcher_names_the_ranks_the_others_stopped_waiting_for(tmp_path, monkeypatch, capfd, hows, named):
    monkeypatch.setenv(mpi_launch.RANK_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", env_with_path(ROOT)["PYTHONPATH"])
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "2")
    fake = [sys.executable, "-c", FAKE_MPIEXEC, FAKE_RANK, *hows, "--"]
    monkeypatch.setattr(mpi_launch, "mpiexec_command", lambda ranks: fake)
    assert mpi_launch.launch(len(hows), ["train", "mlp"]) == 1
    err = capfd.readouterr().err
    pids = {rank: pid for pid, (rank, _) in mpi_launch.read_records(str(tmp_path)).items()}
    if named is None:     # the rank that failed printed its own error: nobody else is to blame
        assert "did not answer" not in err, err
    else:
        assert f"error: {named.format(*[pids[r] for r in range(len(hows))])}\n" in err, err
    assert "ended abnormally" not in err, err


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux 5.3, Python 3.9)")
def test_the_exit_order_holds_when_the_watcher_wakes_late(tmp_path):
    """The ranks end one after another while the watcher's thread cannot run
    (this thread holds the interpreter): it still sees them in that order."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(4)]
    try:
        for rank, proc in enumerate(procs):
            (tmp_path / str(proc.pid)).write_text(str(rank))
        exits = mpi_launch._ExitOrder(str(tmp_path), len(procs))
        exits.start()
        deadline = time.monotonic() + 10
        while _pidfds() < len(procs) and time.monotonic() < deadline:      # every pid watched
            time.sleep(0.01)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(5.0)
        try:
            for i in [2, 0, 3, 1]:
                procs[i].kill()
                end = time.perf_counter() + 0.05
                while time.perf_counter() < end:      # holds the interpreter, unlike sleep
                    pass
        finally:
            sys.setswitchinterval(switch)
        time.sleep(0.2)
        exits.stop()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert exits.order == [procs[i].pid for i in [2, 0, 3, 1]]


def _pidfds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "pidfd" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return count


def test_ranks_record_their_start_and_end(tmp_path):
    code = ("import sys; from flowgrad.training import mpi_launch\n"
            "mpi_launch.record_start(int(sys.argv[1]))\n"
            "if sys.argv[2] == 'fail': mpi_launch.record_failed(int(sys.argv[1]))\n"
            "if sys.argv[2] == 'wait': mpi_launch.record_failed(int(sys.argv[1]), waited=True)\n"
            "if sys.argv[2] == 'die': import os; os._exit(9)\n")
    env = {**env_with_path(ROOT), mpi_launch.RANK_DIR_ENV: str(tmp_path)}
    pids = {}
    ends = ["ended", "failed", "waited", ""]
    for rank, how in enumerate(["end", "fail", "wait", "die"]):
        proc = subprocess.Popen([sys.executable, "-c", code, str(rank), how], env=env)
        proc.wait()
        pids[proc.pid] = rank
    assert mpi_launch.read_records(str(tmp_path)) == {p: (r, ends[r]) for p, r in pids.items()}


def test_strip_ranks():
    assert mpi_launch.strip_ranks(["train", "m", "--ranks", "2", "--ranks=3", "--steps", "5"]) == \
        ["train", "m", "--steps", "5"]


def test_bench_ranks_times_each_rank_count(tmp_path):
    """`flowgrad bench --ranks 2` on mlp: a row per rank count, a graph-free
    numpy step (so quick), the all-reduce a part of the step."""
    mpi_flavours.default()
    proc = subprocess.run([sys.executable, "-m", "flowgrad.cli", "bench", "mlp", "--device", "cpu", "--ranks", "2",
                           "--repeats", "3"], capture_output=True, text=True, env=env_with_path(ROOT), timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("mlp: data-parallel training steps, per-rank batch") and "path closures" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["1", "2"]
    assert float(rows[0][2]) == 0.0 and float(rows[1][2]) > 0.0       # one process has no all-reduce
    assert all(float(r[1]) > 0 for r in rows) and rows[0][-1] == "1.00x"


def test_flavours_are_found_where_their_launcher_is():
    """Under CI the MPI that mpi4py loads as installed must be usable: else every
    launch test would be skipped."""
    found = [f for f in mpi_flavours.FAMILIES if mpi_flavours.find(f)[0] is not None]
    if os.environ.get("CI", "").lower() == "true":
        assert (mpi_flavours.default_family() or mpi_launch.MPICH) in found, mpi_flavours.find(mpi_launch.MPICH)[1]
    elif not found:
        pytest.skip("no MPI here")


def test_ranks_of_another_mpis_launcher_are_an_error_not_singletons(monkeypatch):
    """Each would see one rank and train alone over the same outputs."""
    class FakeMPI:
        @staticmethod
        def Get_library_version():
            return "Open MPI v4.1.4, package: Debian\x00"

    monkeypatch.setenv("PMI_SIZE", "2")
    with pytest.raises(FlowError, match=r"one of 2 ranks \(PMI_SIZE=2\), but MPI sees 1: the launcher is not of "
                                         r"the MPI library mpi4py loads \(Open MPI v4.1.4, package: Debian\)"):
        distributed._check_launcher_matches(FakeMPI, 1)
    distributed._check_launcher_matches(FakeMPI, 2)


def test_mpichs_launcher_with_open_mpi_ranks_says_so(tmp_path):
    mpich, why = mpi_flavours.find(mpi_launch.MPICH)
    ompi, why2 = mpi_flavours.find(mpi_launch.OPEN_MPI)
    if mpich is None or ompi is None:
        pytest.skip(why or why2)
    cmd = mpich.mpiexec(2) + [ompi.python, "-m", "flowgrad.cli", "train", "mlp", "--steps", "1", "--device", "cpu",
                              "--out", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=ompi.environ(env_with_path(ROOT)))
    assert proc.returncode != 0
    assert "error: this process was started as one of 2 ranks (PMI_SIZE=2), but MPI sees 1" in proc.stderr
    assert not (tmp_path / "run").exists()
