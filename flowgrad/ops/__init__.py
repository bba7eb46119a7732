"""All ops. Importing this package registers every op family."""
from flowgrad.ops import elementwise  # noqa: F401  (registers its ops)
from flowgrad.ops.registry import OPS, Arg, Lowering, Op, OpTypeError, get_op, register

__all__ = ["OPS", "Arg", "Lowering", "Op", "OpTypeError", "get_op", "register"]
