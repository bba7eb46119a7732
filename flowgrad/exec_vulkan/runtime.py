"""The Vulkan device runtime: instance, device discovery and selection, the
logical device, buffers, compute pipelines, and submission.

Every Vulkan failure becomes a DeviceError with a message saying what was
being done; nothing here may abort the interpreter. cffi structs that hold a
string or a pointer are kept in local variables until the call that reads
them returns (a struct passed inline can be freed before Vulkan reads it)."""
from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import os
import weakref
from pathlib import Path

import attrs
import numpy as np

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan import faults
from flowgrad.exec_vulkan.spirv import shader_info

VALIDATION_ENV = "FLOWGRAD_VK_VALIDATION"   # "1": Khronos validation layer + message collection
STAGING_ENV = "FLOWGRAD_VK_STAGING"         # "1": never map device buffers, even on unified memory
VALIDATION_LAYER = "VK_LAYER_KHRONOS_validation"
PUSH_BYTES = 128                            # every pipeline layout has one 128-byte push range
FENCE_TIMEOUT_NS = 600 * 10**9

DEVICE_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}

_VK_ERRORS = {
    "VkErrorOutOfHostMemory": "out of host memory (VK_ERROR_OUT_OF_HOST_MEMORY)",
    "VkErrorOutOfDeviceMemory": "out of device memory (VK_ERROR_OUT_OF_DEVICE_MEMORY)",
    "VkErrorInitializationFailed": "initialization failed (VK_ERROR_INITIALIZATION_FAILED)",
    "VkErrorDeviceLost": "the device was lost (VK_ERROR_DEVICE_LOST): a shader faulted, ran too long, "
                         "or the driver reset the GPU",
    "VkErrorMemoryMapFailed": "memory could not be mapped (VK_ERROR_MEMORY_MAP_FAILED)",
    "VkErrorLayerNotPresent": "a requested layer is not installed (VK_ERROR_LAYER_NOT_PRESENT)",
    "VkErrorExtensionNotPresent": "a requested extension is not supported (VK_ERROR_EXTENSION_NOT_PRESENT)",
    "VkErrorFeatureNotPresent": "a requested feature is not supported (VK_ERROR_FEATURE_NOT_PRESENT)",
    "VkErrorIncompatibleDriver": "no compatible Vulkan driver (VK_ERROR_INCOMPATIBLE_DRIVER)",
    "VkErrorTooManyObjects": "too many objects of one type (VK_ERROR_TOO_MANY_OBJECTS)",
    "VkErrorInvalidShaderNv": "the driver rejected the shader (VK_ERROR_INVALID_SHADER_NV)",
    "VkTimeout": "timed out waiting for the device",
}


def _armed_fault() -> bool:
    return bool(faults._armed)


def _vk():
    try:
        import vulkan
    except (ImportError, OSError) as e:
        raise DeviceError(f"the Vulkan loader could not be loaded: {e}",
                          hint="install libvulkan1 and a driver (Debian: mesa-vulkan-drivers for lavapipe)") from None
    return vulkan


@contextlib.contextmanager
def vk_errors(what: str):
    """Turn any exception the `vulkan` binding raises into a DeviceError."""
    vk = _vk()
    try:
        yield vk
    except (vk.VkError, vk.VkException, vk.ProcedureNotFoundError, vk.ExtensionNotSupportedError) as e:
        name = type(e).__name__
        raise DeviceError(f"{what} failed: {_VK_ERRORS.get(name, name)}") from None


# --------------------------------------------------------------------------- instance


class Instance:
    """The process's VkInstance (one, created on first use). With
    FLOWGRAD_VK_VALIDATION=1 it enables the Khronos validation layer and
    collects its messages; errors can be read with validation_errors()."""

    def __init__(self):
        vk = _vk()
        self.validation = os.environ.get(VALIDATION_ENV, "") == "1"
        self.messages: list[tuple[str, str]] = []   # (severity, text)
        self.messenger = None
        layers, exts = [], []
        if self.validation:
            with vk_errors("listing Vulkan layers"):
                available = {layer.layerName for layer in vk.vkEnumerateInstanceLayerProperties()}
            if VALIDATION_LAYER not in available:
                raise DeviceError(f"{VALIDATION_ENV}=1 but {VALIDATION_LAYER} is not installed",
                                  hint="Debian: apt-get install vulkan-validationlayers")
            layers, exts = [VALIDATION_LAYER], ["VK_EXT_debug_utils"]
        app = vk.VkApplicationInfo(pApplicationName="flowgrad", applicationVersion=1, pEngineName="flowgrad",
                                   engineVersion=1, apiVersion=vk.VK_MAKE_VERSION(1, 2, 0))
        info = vk.VkInstanceCreateInfo(pApplicationInfo=app, enabledLayerCount=len(layers),
                                       ppEnabledLayerNames=layers, enabledExtensionCount=len(exts),
                                       ppEnabledExtensionNames=exts)
        with vk_errors("creating the Vulkan instance"):
            self.handle = vk.vkCreateInstance(info, None)
        if self.validation:
            self._install_messenger(vk)

    def _install_messenger(self, vk):
        sev = (vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT | vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT)
        kinds = (vk.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT
                 | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_PERFORMANCE_BIT_EXT)
        self._callback = self._on_message  # the binding keeps only a module-global reference
        info = vk.VkDebugUtilsMessengerCreateInfoEXT(messageSeverity=sev, messageType=kinds,
                                                     pfnUserCallback=self._callback)
        with vk_errors("installing the validation message callback"):
            create = vk.vkGetInstanceProcAddr(self.handle, "vkCreateDebugUtilsMessengerEXT")
            self.messenger = create(self.handle, info, None)

    def _on_message(self, severity, types, data, user):
        try:
            vk = _vk()
            text = vk.ffi.string(data.pMessage).decode("utf-8", "replace") if data.pMessage else "?"
            level = "error" if severity & vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT else "warning"
            self.messages.append((level, text))
        except Exception as e:  # noqa: BLE001 - a callback must never raise into the driver
            self.messages.append(("error", f"(could not read a validation message: {e})"))
        return 0


_INSTANCE: Instance | None = None


def instance() -> Instance:
    global _INSTANCE
    if _INSTANCE is None:
        _INSTANCE = Instance()
    return _INSTANCE


def validation_enabled() -> bool:
    return _INSTANCE is not None and _INSTANCE.validation


def validation_errors() -> list[str]:
    """Validation-layer messages of severity error since the last clear."""
    return [] if _INSTANCE is None else [text for level, text in _INSTANCE.messages if level == "error"]


def clear_validation_messages() -> None:
    if _INSTANCE is not None:
        _INSTANCE.messages.clear()


# --------------------------------------------------------------------------- discovery


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


def _features(vk, physical):
    """(core features, 16-bit storage, float16/int8) structs, filled in."""
    f16 = vk.VkPhysicalDeviceShaderFloat16Int8Features()
    s16 = vk.VkPhysicalDevice16BitStorageFeatures(pNext=f16)
    f2 = vk.VkPhysicalDeviceFeatures2(pNext=s16)
    vk.vkGetPhysicalDeviceFeatures2(physical, vk.ffi.addressof(f2))
    return f2, s16, f16


def _extensions(vk, physical) -> set[str]:
    return {e.extensionName for e in vk.vkEnumerateDeviceExtensionProperties(physical, None)}


def _compute_family(vk, physical) -> tuple[int, int] | None:
    """(queue family index, timestampValidBits): a compute-only family if there is one."""
    families = list(vk.vkGetPhysicalDeviceQueueFamilyProperties(physical))
    compute = [(i, f) for i, f in enumerate(families) if f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT and f.queueCount > 0]
    if not compute:
        return None
    only = [(i, f) for i, f in compute if not f.queueFlags & vk.VK_QUEUE_GRAPHICS_BIT]
    i, f = (only or compute)[0]
    return i, f.timestampValidBits


def _describe(vk, index: int, physical) -> DeviceInfo:
    props = vk.vkGetPhysicalDeviceProperties(physical)
    mem = vk.vkGetPhysicalDeviceMemoryProperties(physical)
    heaps = [mem.memoryHeaps[i] for i in range(mem.memoryHeapCount)]
    local = [h.size for h in heaps if h.flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT] or [h.size for h in heaps]
    f2, s16, f16 = _features(vk, physical)
    exts = _extensions(vk, physical)
    m3 = vk.VkPhysicalDeviceMaintenance3Properties()
    p2 = vk.VkPhysicalDeviceProperties2(pNext=m3)
    vk.vkGetPhysicalDeviceProperties2(physical, vk.ffi.addressof(p2))
    family = _compute_family(vk, physical)
    return DeviceInfo(
        index=index, name=str(props.deviceName), type=DEVICE_TYPES.get(props.deviceType, "other"),
        memory=int(max(local)), f16=bool(s16.storageBuffer16BitAccess and f16.shaderFloat16),
        coopmat=bool({"VK_KHR_cooperative_matrix", "VK_NV_cooperative_matrix"} & exts),
        api_version=_version(props.apiVersion), driver=_version(props.driverVersion),
        timestamps=bool(family and family[1] > 0 and props.limits.timestampPeriod > 0),
        max_allocation=int(m3.maxMemoryAllocationSize),
        max_storage_range=int(props.limits.maxStorageBufferRange),
        max_groups=tuple(int(x) for x in props.limits.maxComputeWorkGroupCount))


def _physical_devices():
    vk = _vk()
    inst = instance()
    with vk_errors("enumerating Vulkan devices"):
        return list(vk.vkEnumeratePhysicalDevices(inst.handle))


def list_devices() -> list[DeviceInfo]:
    """Every Vulkan device, in the loader's order. Empty if Vulkan is absent."""
    try:
        vk = _vk()
        physicals = _physical_devices()
    except DeviceError:
        return []
    with vk_errors("reading device properties"):
        return [_describe(vk, i, p) for i, p in enumerate(physicals)]


def list_devices_text() -> str:
    """What `flowgrad devices` prints."""
    try:
        instance()     # a loader or validation-layer problem is worth showing as such
    except DeviceError as e:
        return f"no Vulkan devices: {e}"
    devices = list_devices()
    if not devices:
        return ("no Vulkan devices (install a Vulkan driver; Debian: mesa-vulkan-drivers gives lavapipe, "
                "a CPU device usable with --device vulkan)")
    lines = []
    for d in devices:
        caps = ", ".join(x for x, ok in (("f16", d.f16), ("cooperative matrix", d.coopmat),
                                          ("timestamps", d.timestamps)) if ok) or "f32 only"
        auto = "  <- auto" if d.is_gpu and d.index == _first_gpu(devices) else ""
        lines.append(f"vulkan:{d.index}  {d.name}  [{d.type}]  {d.memory / 2**30:.1f} GiB  "
                     f"Vulkan {d.api_version}  ({caps}){auto}")
    if _first_gpu(devices) is None:
        lines.append("device='auto' runs on numpy (no GPU); --device vulkan uses vulkan:0")
    return "\n".join(lines)


def _first_gpu(devices) -> int | None:
    return next((d.index for d in devices if d.is_gpu), None)


_DEVICES: dict[tuple[int, bool], Device] = {}


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
        index = _first_gpu(devices)
        return None if index is None else open_device(index)
    if spec == "vulkan":
        devices = list_devices()
        if not devices:
            raise DeviceError("device='vulkan' but no Vulkan device was found",
                              hint="install a Vulkan driver (Debian: mesa-vulkan-drivers for lavapipe)")
        index = _first_gpu(devices)
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
    if key not in _DEVICES:
        _DEVICES[key] = Device(index, staging=bool(staging))
    return _DEVICES[key]


# --------------------------------------------------------------------------- device


class Buffer:
    """One VkBuffer with its own memory. `array` is a uint8 numpy view of the
    mapped memory when the buffer is host-visible, else None."""

    def __init__(self, device: Device, nbytes: int, kind: str):
        vk = _vk()
        self.device = device
        self.kind = kind
        self.nbytes = int(nbytes)
        size = max(16, -(-self.nbytes // 16) * 16)   # whole words, so fills may cover the tail
        self.size = size
        device.check_allocation(size, kind)
        usage = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                 | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        info = vk.VkBufferCreateInfo(size=size, usage=usage, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE)
        with vk_errors(f"creating a {size}-byte buffer"):
            self.handle = vk.vkCreateBuffer(device.handle, info, None)
        try:
            req = vk.vkGetBufferMemoryRequirements(device.handle, self.handle)
            type_index, mapped = device.memory_type(kind, req.memoryTypeBits)
            alloc = vk.VkMemoryAllocateInfo(allocationSize=req.size, memoryTypeIndex=type_index)
            what = f"allocating {_mib(req.size)} of {kind} memory on {device.info.name}"
            if faults.hit("alloc"):
                raise DeviceError(f"{what} failed: {_VK_ERRORS['VkErrorOutOfDeviceMemory']} (injected fault)")
            with vk_errors(what):
                self.memory = vk.vkAllocateMemory(device.handle, alloc, None)
        except BaseException:
            vk.vkDestroyBuffer(device.handle, self.handle, None)
            raise
        self.array = None
        try:
            with vk_errors("binding buffer memory"):
                vk.vkBindBufferMemory(device.handle, self.handle, self.memory, 0)
            if mapped:
                with vk_errors("mapping buffer memory"):
                    self.array = np.frombuffer(vk.vkMapMemory(device.handle, self.memory, 0, size, 0), np.uint8)
        except BaseException:
            _free(device.handle, self.handle, self.memory)
            raise
        device.live_bytes += size
        device.objects["buffer"] += 1
        self._finalizer = weakref.finalize(self, _free_buffer, device, self.handle, self.memory, size)
        self._finalizer.atexit = False

    @property
    def mapped(self) -> bool:
        return self.array is not None

    def write(self, data: np.ndarray, offset: int = 0) -> None:
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self.array[offset:offset + raw.size] = raw

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset:offset + nbytes].copy()

    def free(self) -> None:
        self._finalizer()


def _free(dev, buf, mem):
    vk = _vk()
    vk.vkDestroyBuffer(dev, buf, None)
    vk.vkFreeMemory(dev, mem, None)


def _free_buffer(device, buf, mem, size):
    if device.handle is None:
        return
    _free(device.handle, buf, mem)
    device.live_bytes -= size
    device.objects["buffer"] -= 1


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


@attrs.frozen
class Pipeline:
    handle: object
    layout: object
    set_layout: object
    bindings: int


class Device:
    """A logical device with one compute queue, a command pool, a pipeline
    cache, and the pipelines built so far."""

    def __init__(self, index: int, staging: bool = False):
        vk = _vk()
        physicals = _physical_devices()
        if not 0 <= index < len(physicals):
            raise DeviceError(f"no Vulkan device {index} ({len(physicals)} found)")
        self.physical = physicals[index]
        with vk_errors("reading device properties"):
            self.info = _describe(vk, index, self.physical)
            props = vk.vkGetPhysicalDeviceProperties(self.physical)
            self.limits = props.limits
            self.min_align = int(props.limits.minStorageBufferOffsetAlignment)
            self.max_storage_range = int(props.limits.maxStorageBufferRange)
            self.max_groups = tuple(int(x) for x in props.limits.maxComputeWorkGroupCount)
            self.timestamp_period = float(props.limits.timestampPeriod)
            self.uuid = bytes(props.pipelineCacheUUID)
            self._mem = vk.vkGetPhysicalDeviceMemoryProperties(self.physical)
        family = _compute_family(vk, self.physical)
        if family is None:
            raise DeviceError(f"{self.info.name} has no compute queue")
        self.family = family[0]
        self.handle = None
        self._fence = None
        self._abandoned_fences: list = []   # fences that timed out: destroyed once the device is idle
        self.lost: str | None = None        # why the device can't be used any more, once it can't
        self.objects: collections.Counter = collections.Counter()   # live buffers and command buffers
        self._create_device(vk)
        self.live_bytes = 0
        self.unified = self._device_memory_is_mappable()
        self.staging = staging or not self.unified
        self.pipelines: dict[tuple, Pipeline] = {}
        self._set_layouts: dict[int, tuple] = {}
        self._create_pool_and_cache(vk)
        self.pool = BufferPool(self)
        # what reached the device: submits, dispatches, host uploads and downloads (for bench / explain)
        self.stats: collections.Counter = collections.Counter()
        atexit.register(self.save_pipeline_cache)

    # -- creation

    def _create_device(self, vk):
        _, s16, f16 = _features(vk, self.physical)
        want_f16 = vk.VkPhysicalDeviceShaderFloat16Int8Features(shaderFloat16=f16.shaderFloat16)
        want_s16 = vk.VkPhysicalDevice16BitStorageFeatures(pNext=want_f16,
                                                           storageBuffer16BitAccess=s16.storageBuffer16BitAccess)
        # Cooperative matrices are reported (DeviceInfo.coopmat) but not enabled: no shipped shader
        # uses them yet, and Debian's validation layer (1.3.239) rejects their feature struct.
        exts = []
        chain = want_s16
        core = vk.VkPhysicalDeviceFeatures()
        f2 = vk.VkPhysicalDeviceFeatures2(pNext=chain, features=core)
        priority = vk.ffi.new("float[1]", [1.0])
        queue_info = vk.VkDeviceQueueCreateInfo(queueFamilyIndex=self.family, queueCount=1, pQueuePriorities=priority)
        info = vk.VkDeviceCreateInfo(pNext=f2, queueCreateInfoCount=1, pQueueCreateInfos=[queue_info],
                                     enabledExtensionCount=len(exts), ppEnabledExtensionNames=exts)
        with vk_errors(f"creating a logical device on {self.info.name}"):
            self.handle = vk.vkCreateDevice(self.physical, info, None)
            self.queue = vk.vkGetDeviceQueue(self.handle, self.family, 0)

    def _create_pool_and_cache(self, vk):
        info = vk.VkCommandPoolCreateInfo(queueFamilyIndex=self.family,
                                          flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT)
        with vk_errors("creating a command pool"):
            self.command_pool = vk.vkCreateCommandPool(self.handle, info, None)
        data = self._cache_file().read_bytes() if self._cache_file().is_file() else b""
        self._cache_data = data    # kept alive until the cache is created
        info = (vk.VkPipelineCacheCreateInfo(initialDataSize=len(data), pInitialData=vk.ffi.from_buffer(data))
                if data else vk.VkPipelineCacheCreateInfo())
        try:
            with vk_errors("creating the pipeline cache"):
                self.pipeline_cache = vk.vkCreatePipelineCache(self.handle, info, None)
        except DeviceError:   # a stale or corrupt cache file is only a cache: start empty
            with vk_errors("creating the pipeline cache"):
                self.pipeline_cache = vk.vkCreatePipelineCache(self.handle, vk.VkPipelineCacheCreateInfo(), None)

    def _cache_file(self) -> Path:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flowgrad"
        key = hashlib.sha1(self.uuid + self.info.name.encode() + self.info.driver.encode()).hexdigest()[:16]
        return root / f"pipelines-{key}.bin"

    def save_pipeline_cache(self) -> None:
        """Write the pipeline cache to ~/.cache/flowgrad (best effort: it is a cache)."""
        if self.handle is None:
            return
        vk = _vk()
        try:
            size = vk.ffi.new("size_t*")
            vk.vkGetPipelineCacheData(self.handle, self.pipeline_cache, size, vk.ffi.NULL)
            data = vk.ffi.new("char[]", size[0])
            vk.vkGetPipelineCacheData(self.handle, self.pipeline_cache, size, data)
            path = self._cache_file()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(vk.ffi.buffer(data, size[0])[:])
            tmp.replace(path)
        except Exception:  # noqa: BLE001 - failing to save a cache must not fail the program
            pass

    # -- memory

    def _types(self):
        return [(i, self._mem.memoryTypes[i]) for i in range(self._mem.memoryTypeCount)]

    def _device_memory_is_mappable(self) -> bool:
        vk = _vk()
        want = (vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT | vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
                | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT)
        heaps = self._mem.memoryHeaps
        # only when the mappable device-local memory is the whole device-local heap (unified memory),
        # not a small BAR window of a discrete GPU
        return any((t.propertyFlags & want) == want and heaps[t.heapIndex].size >= self.info.memory
                   for _, t in self._types()) and self.info.type in ("cpu", "integrated", "virtual")

    def memory_type(self, kind: str, allowed_bits: int) -> tuple[int, bool]:
        """(memory type index, map it?) for kind "device", "upload" or "download"."""
        vk = _vk()
        local, visible = vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
        coherent, cached = vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT, vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT
        types = [(i, t.propertyFlags) for i, t in self._types() if allowed_bits & (1 << i)]
        if kind == "device":
            if not self.staging:
                prefs = [local | visible | coherent]
            else:
                prefs = [local]
            mapped = not self.staging
        else:
            extra = cached if kind == "download" else 0
            prefs = [visible | coherent | extra, visible | coherent]
            mapped = True
        for want in prefs:
            # on a discrete GPU, staging wants system memory: prefer types without DEVICE_LOCAL
            for avoid_local in ((True, False) if kind != "device" else (False,)):
                for i, flags in types:
                    if (flags & want) == want and not (avoid_local and flags & local):
                        return i, mapped
        raise DeviceError(f"{self.info.name} has no memory type for {kind} buffers")

    def check_allocation(self, size: int, kind: str) -> None:
        limit = self.info.max_allocation or self.info.memory
        if size > limit or (kind == "device" and size > self.info.memory):
            raise DeviceError(
                f"cannot allocate {_mib(size)} on {self.info.name}: larger than the device allows "
                f"(largest allocation {_mib(limit)}, device memory {_mib(self.info.memory)})",
                hint="use a smaller batch or model, or a device with more memory")

    def buffer(self, nbytes: int, kind: str = "device") -> Buffer:
        if kind not in ("device", "upload", "download"):
            raise ValueError(f"buffer kind must be device, upload or download, got {kind!r}")
        self.check_usable()
        return Buffer(self, nbytes, kind)

    # -- pipelines

    def set_layout(self, n: int):
        """(descriptor set layout, pipeline layout) for n storage buffers + the push range."""
        if n not in self._set_layouts:
            vk = _vk()
            bindings = [vk.VkDescriptorSetLayoutBinding(binding=i, descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                        descriptorCount=1, stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT)
                        for i in range(n)]
            info = vk.VkDescriptorSetLayoutCreateInfo(bindingCount=n, pBindings=bindings if n else None)
            with vk_errors(f"creating a descriptor set layout for {n} buffers"):
                set_layout = vk.vkCreateDescriptorSetLayout(self.handle, info, None)
            push = vk.VkPushConstantRange(stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0, size=PUSH_BYTES)
            layouts = [set_layout]
            info = vk.VkPipelineLayoutCreateInfo(setLayoutCount=1, pSetLayouts=layouts, pushConstantRangeCount=1,
                                                 pPushConstantRanges=[push])
            with vk_errors("creating a pipeline layout"):
                layout = vk.vkCreatePipelineLayout(self.handle, info, None)
            self._set_layouts[n] = (set_layout, layout)
        return self._set_layouts[n]

    def pipeline(self, shader: str, variant: str | None = None) -> Pipeline:
        key = (shader, variant)
        if key not in self.pipelines:
            self.pipelines[key] = self._build_pipeline(shader, variant)
        return self.pipelines[key]

    def _build_pipeline(self, shader: str, variant: str | None) -> Pipeline:
        vk = _vk()
        spec = shader_info(shader, variant)
        if variant == "f16" and not self.info.f16:
            raise DeviceError(f"{self.info.name} has no 16-bit storage / float16 support for shader {spec.name}")
        set_layout, layout = self.set_layout(spec.bindings)
        code = spec.code
        module_info = vk.VkShaderModuleCreateInfo(codeSize=len(code), pCode=code)
        with vk_errors(f"loading shader {spec.name}"):
            module = vk.vkCreateShaderModule(self.handle, module_info, None)
        try:
            stage = vk.VkPipelineShaderStageCreateInfo(stage=vk.VK_SHADER_STAGE_COMPUTE_BIT, module=module,
                                                       pName="main")
            info = vk.VkComputePipelineCreateInfo(stage=stage, layout=layout)
            infos = [info]
            with vk_errors(f"building the compute pipeline for shader {spec.name}"):
                handle = vk.vkCreateComputePipelines(self.handle, self.pipeline_cache, 1, infos, None)[0]
        finally:
            vk.vkDestroyShaderModule(self.handle, module, None)
        return Pipeline(handle, layout, set_layout, spec.bindings)

    # -- submission

    def command_buffer(self):
        vk = _vk()
        self.check_usable()
        info = vk.VkCommandBufferAllocateInfo(commandPool=self.command_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
                                              commandBufferCount=1)
        with vk_errors("allocating a command buffer"):
            cmd = vk.vkAllocateCommandBuffers(self.handle, info)[0]
        self.objects["command_buffer"] += 1
        return cmd

    def free_command_buffer(self, cmd) -> None:
        if self.handle is not None:
            _vk().vkFreeCommandBuffers(self.handle, self.command_pool, 1, [cmd])
            self.objects["command_buffer"] -= 1

    def check_usable(self) -> None:
        if self.lost is not None:
            raise DeviceError(f"{self.info.name} can't be used any more: {self.lost}",
                              hint="compile a new session (in a new process if the driver reset the GPU)")

    def live_objects(self) -> dict:
        """Vulkan objects that sessions create, alive now (buffers the pool keeps
        included; not the device's own fence): leak checks compare two of these."""
        out = {k: v for k, v in self.objects.items() if v}
        if self._abandoned_fences:
            out["timed-out fence"] = len(self._abandoned_fences)
        return out

    def submit_and_wait(self, cmd, what: str = "running commands") -> None:
        """One submission of a recorded command buffer; returns when it is done.
        A timeout or a lost device marks the device lost (check_usable)."""
        vk = _vk()
        self.check_usable()
        what = f"{what} on {self.info.name}"
        if faults.hit("submit"):
            raise DeviceError(f"{what} failed: {_VK_ERRORS['VkErrorOutOfHostMemory']} at submission (injected fault)")
        self.stats["submits"] += 1
        try:
            with vk_errors(what):
                if self._fence is None:
                    self._fence = vk.vkCreateFence(self.handle, vk.VkFenceCreateInfo(), None)
                fences = [self._fence]
                cmds = [cmd]
                submit = vk.VkSubmitInfo(commandBufferCount=1, pCommandBuffers=cmds)
                vk.vkQueueSubmit(self.queue, 1, [submit], self._fence)
                try:
                    vk.vkWaitForFences(self.handle, 1, fences, vk.VK_TRUE, FENCE_TIMEOUT_NS)
                    if faults.hit("fence_timeout"):   # the work is done; pretend it was not
                        raise vk.VkTimeout()
                except vk.VkTimeout:
                    # the fence may still signal later: never reuse it
                    self._abandoned_fences.append(self._fence)
                    self._fence = None
                    raise
                if faults.hit("device_lost"):
                    raise vk.VkErrorDeviceLost()
                vk.vkResetFences(self.handle, 1, fences)
        except DeviceError as e:
            if "VK_ERROR_DEVICE_LOST" in e.message or "timed out" in e.message:
                self.lost = e.message + (" (injected fault)" if _armed_fault() else "")
                e.message = self.lost
                e.args = (self.lost,)
            raise

    def wait_idle(self) -> None:
        with vk_errors("waiting for the device"):
            _vk().vkDeviceWaitIdle(self.handle)

    def __repr__(self) -> str:
        mode = "staging" if self.staging else "mapped"
        return f"<Device vulkan:{self.info.index} {self.info.name} ({self.info.type}, {mode})>"


class BufferPool:
    """Reuses buffers across one-op-at-a-time submissions (the closure path
    would otherwise allocate device memory for every op). Sizes are rounded
    to powers of two; at most `keep` bytes are kept per kind."""

    def __init__(self, device: Device, keep: int = 256 * 2**20):
        self.device = device
        self.keep = keep
        self.free: dict[tuple[str, int], list[Buffer]] = {}
        self.kept = 0

    def acquire(self, nbytes: int, kind: str) -> Buffer:
        size = 256
        while size < nbytes:
            size *= 2
        bucket = self.free.get((kind, size))
        if bucket:
            self.kept -= size
            return bucket.pop()
        return self.device.buffer(size, kind)

    def release(self, buf: Buffer) -> None:
        if self.kept + buf.nbytes > self.keep:
            buf.free()
            return
        self.kept += buf.nbytes
        self.free.setdefault((buf.kind, buf.nbytes), []).append(buf)
