"""The MPI implementations the data-parallel tests start ranks with: for
each (MPICH, Open MPI), a Python and environment in which mpi4py loads it,
and its launcher, as `--ranks` would choose it.

Found by asking mpi4py, in order: the Python named by FLOWGRAD_TEST_MPI_PYTHON
(e.g. a venv whose mpi4py was built against the system's Open MPI), then this
one as it is, then this one with MPI4PY_MPIABI set to each MPI ABI its mpi4py
wheel ships (the wheel loads MPICH or Open MPI at run time). Under CI=true the
implementation this Python's mpi4py loads as it is must be found with its
launcher (the dev extra brings mpi4py and the mpich wheel); another one is
tested where it is present and skipped, with the reason, where it is not."""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from flowgrad.errors import FlowError
from flowgrad.training import mpi_launch

FAMILIES = (mpi_launch.MPICH, mpi_launch.OPEN_MPI)
PYTHON_ENV = "FLOWGRAD_TEST_MPI_PYTHON"
CI = os.environ.get("CI", "").lower() == "true"


@dataclass(frozen=True)
class Flavour:
    family: str
    python: str
    env: tuple          # (name, value) pairs added to the environment

    def environ(self, base: dict | None = None) -> dict:
        return {**(os.environ if base is None else base), **dict(self.env)}

    def mpiexec(self, ranks: int) -> list[str]:
        return mpi_launch.mpiexec_command(ranks, self.python, self.environ())

    def __str__(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env)
        return f"{self.family} ({self.python}{' with ' + env if env else ''})"


def shipped_abis() -> list[str]:
    spec = importlib.util.find_spec("mpi4py")
    if spec is None or not spec.submodule_search_locations:
        return []
    names = [p.name for d in spec.submodule_search_locations for p in Path(d).glob("MPI.*.*")]
    return sorted({n.split(".")[1] for n in names if n.count(".") >= 3})


def candidates():
    other = os.environ.get(PYTHON_ENV)
    if other:
        yield other, ()
    yield sys.executable, ()
    for abi in shipped_abis():
        yield sys.executable, (("MPI4PY_MPIABI", abi),)


@functools.cache
def library(python: str, env: tuple):
    try:
        return mpi_launch.mpi_library(python, {**os.environ, **dict(env)})[0]
    except FlowError:
        return None


@functools.cache
def default_family() -> str | None:
    return library(sys.executable, ())


@functools.cache
def find(family: str) -> tuple[Flavour | None, str]:
    for python, env in candidates():
        if library(python, env) == family:
            flavour = Flavour(family, python, env)
            try:
                flavour.mpiexec(2)
            except FlowError as e:
                return None, f"{flavour}: {e}"
            return flavour, ""
    return None, f"no mpi4py here loads {family} (set {PYTHON_ENV} to a Python whose mpi4py does)"


def flavour_or_skip(family: str) -> Flavour:
    flavour, why = find(family)
    if flavour is not None:
        return flavour
    required = default_family() or mpi_launch.MPICH
    if CI and family == required:
        pytest.fail(f"under CI=true the MPI that mpi4py loads must start ranks: {why}")
    pytest.skip(why)


def default() -> Flavour:
    return flavour_or_skip(default_family() or mpi_launch.MPICH)
