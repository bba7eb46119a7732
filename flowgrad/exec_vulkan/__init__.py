"""The Vulkan side: device runtime, shaders, the resident graph executor, and
the per-op kernels the closure executor uses on a Vulkan device.

    select_device(spec) -> Device | None   "auto", "vulkan", "vulkan:N"
    Device.info                            DeviceInfo (name, type, memory, f16, coopmat)
    GraphSession(graph, plan, device, params)   same methods as exec_closure.ClosureSession
    VulkanKernels(device)                  same methods as exec_closure.NumpyKernels
"""
from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.recorder import BufView, Recorder, grid
from flowgrad.exec_vulkan.runtime import (DeviceInfo, list_devices, select_device,
                                          validation_errors)


def __getattr__(name):
    # the executors import the op registry; load them only when asked for
    if name == "VulkanKernels":
        from flowgrad.exec_vulkan.kernels import VulkanKernels

        return VulkanKernels
    if name == "GraphSession":
        from flowgrad.exec_vulkan.graph_session import GraphSession

        return GraphSession
    if name == "count_dispatches":
        from flowgrad.exec_vulkan.program import count_dispatches

        return count_dispatches
    raise AttributeError(name)


__all__ = ["BufView", "DeviceError", "DeviceInfo", "GraphSession", "Recorder", "VulkanKernels", "count_dispatches",
           "grid",
           "list_devices", "select_device", "validation_errors"]
