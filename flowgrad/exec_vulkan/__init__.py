"""The Vulkan side: device runtime, shaders, the resident graph executor, and
the per-op kernels the closure executor uses on a Vulkan device.

    select_device(spec) -> Device | None   "auto", "vulkan", "vulkan:N"
    Device.info                            DeviceInfo (name, type, memory, f16, coopmat)
    GraphSession(graph, plan, device, params)   same methods as exec_closure.ClosureSession
    VulkanKernels(device)                  same methods as exec_closure.NumpyKernels
"""
