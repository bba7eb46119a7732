"""Device discovery: what each Vulkan device is and can do (DeviceInfo),
read from the physical device without opening it."""
from __future__ import annotations

import attrs

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.instance import load_vulkan, instance, vk_errors

DEVICE_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}


@attrs.frozen
class DeviceInfo:
    index: int
    name: str
    type: str                  # discrete, integrated, cpu, virtual, other
    memory: int                # bytes of the largest device-local heap
    f16: bool                  # storageBuffer16BitAccess and shaderFloat16
    coopmat: bool              # VK_KHR_cooperative_matrix (or the NV extension)
    api_version: str = ""
    driver: str = ""
    timestamps: bool = False   # timestamp queries on the compute queue
    max_allocation: int = 0    # bytes, maxMemoryAllocationSize
    max_storage_range: int = 0  # bytes one storage-buffer binding may address (0: unknown)
    max_groups: tuple = ()     # maxComputeWorkGroupCount ((): unknown)

    @property
    def is_gpu(self) -> bool:
        return self.type in ("discrete", "integrated")

    def __str__(self) -> str:
        return f"{self.name} ({self.type})"


def _version(v: int) -> str:
    return f"{v >> 22}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


def features(vk, physical):
    """(core features, 16-bit storage, float16/int8) structs, filled in."""
    f16 = vk.VkPhysicalDeviceShaderFloat16Int8Features()
    s16 = vk.VkPhysicalDevice16BitStorageFeatures(pNext=f16)
    f2 = vk.VkPhysicalDeviceFeatures2(pNext=s16)
    vk.vkGetPhysicalDeviceFeatures2(physical, vk.ffi.addressof(f2))
    return f2, s16, f16


def _extensions(vk, physical) -> set[str]:
    return {e.extensionName for e in vk.vkEnumerateDeviceExtensionProperties(physical, None)}


def compute_family(vk, physical) -> tuple[int, int] | None:
    """(queue family index, timestampValidBits): a compute-only family if there is one."""
    families = list(vk.vkGetPhysicalDeviceQueueFamilyProperties(physical))
    compute = [(i, f) for i, f in enumerate(families) if f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT and f.queueCount > 0]
    if not compute:
        return None
    only = [(i, f) for i, f in compute if not f.queueFlags & vk.VK_QUEUE_GRAPHICS_BIT]
    i, f = (only or compute)[0]
    return i, f.timestampValidBits


def describe(vk, index: int, physical) -> DeviceInfo:
    props = vk.vkGetPhysicalDeviceProperties(physical)
    mem = vk.vkGetPhysicalDeviceMemoryProperties(physical)
    heaps = [mem.memoryHeaps[i] for i in range(mem.memoryHeapCount)]
    local = [h.size for h in heaps if h.flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT] or [h.size for h in heaps]
    f2, s16, f16 = features(vk, physical)
    exts = _extensions(vk, physical)
    m3 = vk.VkPhysicalDeviceMaintenance3Properties()
    p2 = vk.VkPhysicalDeviceProperties2(pNext=m3)
    vk.vkGetPhysicalDeviceProperties2(physical, vk.ffi.addressof(p2))
    family = compute_family(vk, physical)
    return DeviceInfo(
        index=index, name=str(props.deviceName), type=DEVICE_TYPES.get(props.deviceType, "other"),
        memory=int(max(local)), f16=bool(s16.storageBuffer16BitAccess and f16.shaderFloat16),
        coopmat=bool({"VK_KHR_cooperative_matrix", "VK_NV_cooperative_matrix"} & exts),
        api_version=_version(props.apiVersion), driver=_version(props.driverVersion),
        timestamps=bool(family and family[1] > 0 and props.limits.timestampPeriod > 0),
        max_allocation=int(m3.maxMemoryAllocationSize),
        max_storage_range=int(props.limits.maxStorageBufferRange),
        max_groups=tuple(int(x) for x in props.limits.maxComputeWorkGroupCount))


def physical_devices():
    vk = load_vulkan()
    inst = instance()
    with vk_errors("enumerating Vulkan devices"):
        return list(vk.vkEnumeratePhysicalDevices(inst.handle))


def list_devices() -> list[DeviceInfo]:
    """Every Vulkan device, in the loader's order. Empty if Vulkan is absent."""
    try:
        vk = load_vulkan()
        physicals = physical_devices()
    except DeviceError:
        return []
    with vk_errors("reading device properties"):
        return [describe(vk, i, p) for i, p in enumerate(physicals)]


def first_gpu(devices) -> int | None:
    """The index of the device "auto" picks, if any."""
    return next((d.index for d in devices if d.is_gpu), None)
