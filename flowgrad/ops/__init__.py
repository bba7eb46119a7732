"""All ops. Importing this package registers every op family."""
from flowgrad.ops import elementwise, linalg, reduce, norm, loss, shape, attention  # noqa: F401, I001  (register ops; this order is the docs' order)
from flowgrad.ops import activations, elementwise_loss, compare, batchnorm, conv, pool, random, spatial  # noqa: F401, I001
from flowgrad.ops import index, einsum  # noqa: F401, I001
from flowgrad.ops.registry import OPS, Arg, Op, OpTypeError, get_op, register

# the built-in ops, in family order (user ops registered later are not among them)
BUILTIN = tuple(OPS)

from flowgrad.ops import fused  # noqa: E402, F401, I001  (the planner's fused chains: not a built-in op)
from flowgrad.ops import scan  # noqa: E402, F401, I001  (made by the scan() built-in: not called by name)

__all__ = ["BUILTIN", "OPS", "Arg", "Op", "OpTypeError", "get_op", "register"]
