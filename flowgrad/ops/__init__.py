"""All ops. Importing this package registers every op family."""
from flowgrad.ops import attention, elementwise, linalg, loss, norm, reduce, shape  # noqa: F401  (register ops)
from flowgrad.ops.registry import OPS, Arg, Op, OpTypeError, get_op, register

__all__ = ["OPS", "Arg", "Op", "OpTypeError", "get_op", "register"]
