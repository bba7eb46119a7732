"""The Vulkan runtime's entry points: choosing and opening a device, and the
names the rest of flowgrad uses. The parts live in instance (loader,
VkInstance, validation), discovery (DeviceInfo, listing), device (Device,
pipelines, submission) and buffers (Buffer, BufferPool)."""
from __future__ import annotations

import os
import threading

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.buffers import Buffer, BufferPool
from flowgrad.exec_vulkan.device import PUSH_BYTES, Device, Pipeline
from flowgrad.exec_vulkan.discovery import DeviceInfo, first_gpu, list_devices
from flowgrad.exec_vulkan.instance import (clear_validation_messages, instance, validation_enabled,
                                           validation_errors, vk_errors)

STAGING_ENV = "FLOWGRAD_VK_STAGING"         # "1": never map device buffers, even on unified memory

_DEVICES: dict[tuple[int, bool], Device] = {}
_OPENING = threading.Lock()   # two threads opening a device at once get the same one


def select_device(spec: str = "auto") -> Device | None:
    """"auto": the first discrete or integrated GPU, else None (numpy);
    "vulkan": the first GPU, else any Vulkan device (lavapipe too), else a
    DeviceError; "vulkan:N": device N. Devices are opened once per process."""
    spec = str(spec)
    if spec == "auto":
        try:
            devices = list_devices()
        except DeviceError:
            return None
        index = first_gpu(devices)
        return None if index is None else open_device(index)
    if spec == "vulkan":
        devices = list_devices()
        if not devices:
            raise DeviceError("device='vulkan' but no Vulkan device was found",
                              hint="install a Vulkan driver (Debian: mesa-vulkan-drivers for lavapipe)")
        index = first_gpu(devices)
        return open_device(devices[0].index if index is None else index)
    if spec.startswith("vulkan:"):
        try:
            index = int(spec.split(":", 1)[1])
        except ValueError:
            raise DeviceError(f"bad device {spec!r}: expected vulkan:N with N an integer") from None
        devices = list_devices()
        if not 0 <= index < len(devices):
            have = ", ".join(f"vulkan:{d.index} ({d.name})" for d in devices) or "none"
            raise DeviceError(f"no Vulkan device {index}; devices: {have}")
        return open_device(index)
    raise DeviceError(f"unknown device {spec!r}: use 'auto', 'vulkan' or 'vulkan:N'")


def open_device(index: int, staging: bool | None = None) -> Device:
    """The process's Device for physical device `index`. staging=True never
    maps device buffers (as on a discrete GPU) even where memory is unified;
    default: FLOWGRAD_VK_STAGING, else what the device's memory allows."""
    if staging is None:
        staging = os.environ.get(STAGING_ENV, "") == "1"
    key = (index, bool(staging))
    with _OPENING:
        if key not in _DEVICES:
            _DEVICES[key] = Device(index, staging=bool(staging))
        return _DEVICES[key]


__all__ = ["PUSH_BYTES", "STAGING_ENV", "Buffer", "BufferPool", "Device", "DeviceInfo", "Pipeline",
           "clear_validation_messages", "first_gpu", "instance", "list_devices", "open_device", "select_device",
           "validation_enabled", "validation_errors", "vk_errors"]
