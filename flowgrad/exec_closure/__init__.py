"""The closure executor: a tape of per-node closures, always correct."""
from flowgrad.exec_closure.tape import ClosureExecutor, ClosureSession, NumpyKernels

__all__ = ["ClosureExecutor", "ClosureSession", "NumpyKernels"]
