"""Graph lowerings: the Python glue that records an op's Vulkan dispatches.

One module per op family (linalg, attention, shape, ...). Each exposes
`Lowering` objects that the op's record carries (`lowering=` in flowgrad/ops).
Lowerings only call Recorder methods and read node attrs / view shapes, so a
dry-run Recorder can count their dispatches without a device."""
