"""Graph lowerings: the Python glue that records an op's Vulkan dispatches.

One module per op family (linalg, attention, shape, ...); each registers its
ops' `Lowering`s by name in exec_vulkan/lowering.py. Importing this package
imports them all, so `lowering_for` sees every built-in lowering. Lowerings
only call Recorder methods and read node attrs / view shapes, so a dry-run
Recorder can count their dispatches without a device."""
import attrs

from flowgrad.exec_vulkan.lower import attention, elementwise, linalg, loss, norm, reduce, shape  # noqa: F401
from flowgrad.exec_vulkan.lower import batchnorm, compare, conv, pointwise, pool, random, spatial  # noqa: F401
from flowgrad.exec_vulkan.lower import index  # noqa: F401
from flowgrad.exec_vulkan.lower import fused  # noqa: F401, E402
from flowgrad.exec_vulkan.lower import split_product  # noqa: F401, E402
from flowgrad.exec_vulkan.lower import scan  # noqa: F401, E402
from flowgrad.exec_vulkan.lowering import FLOATS, LOWERINGS, Lowering  # noqa: E402
from flowgrad.exec_vulkan.lower.derived import derived_backward  # noqa: E402

_DERIVED: dict[str, tuple] = {}   # op name -> (its lowering, that lowering with the derived backward)


def lowering_for(op_name: str) -> Lowering | None:
    """The op's Vulkan lowering, or None when it runs on closures only. A
    lowering that records no backward, of an op with a grad rule, gets that
    rule recorded through its ops' forward lowerings."""
    low = LOWERINGS.get(op_name)
    if low is None or low.backward is not None:
        return low
    from flowgrad.ops import OPS

    op = OPS.get(op_name)
    if op is None or op.grad is None:
        return low
    if _DERIVED.get(op_name, (None,))[0] is not low:
        _DERIVED[op_name] = (low, attrs.evolve(low, backward=derived_backward(op_name, lowering_for),
                                               bwd_dtypes=low.dtypes & FLOATS))
    return _DERIVED[op_name][1]
