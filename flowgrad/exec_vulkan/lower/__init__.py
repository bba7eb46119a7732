"""Graph lowerings: the Python glue that records an op's Vulkan dispatches.

One module per op family (linalg, attention, shape, ...); each registers its
ops' `Lowering`s by name in exec_vulkan/lowering.py. Importing this package
imports them all, so `lowering_for` sees every built-in lowering. Lowerings
only call Recorder methods and read node attrs / view shapes, so a dry-run
Recorder can count their dispatches without a device."""
from flowgrad.exec_vulkan.lower import (  # noqa: F401
    attention, elementwise, linalg, loss, norm, reduce, shape, batchnorm, compare, conv, pointwise, pool, random,
    spatial, index, fused, split_product, scan)
from flowgrad.exec_vulkan.lowering import LOWERINGS, Lowering


def lowering_for(op_name: str) -> Lowering | None:
    """The op's Vulkan lowering, or None when it runs on closures only."""
    return LOWERINGS.get(op_name)
