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
    coopmat_f16: bool = False  # VK_NV_cooperative_matrix with 16x16x16 f16 products into f32 (matmul_coop)
    coopmat_khr_f16: bool = False  # the same products on VK_KHR_cooperative_matrix (matmul_coop_khr)
    storage_buffers: int = 0   # maxPerStageDescriptorStorageBuffers (0: unknown)
    # VK_NV_cooperative_matrix2 (matmul_cm2): the workgroup sizes that take workgroup-scope f16 x f16 + f32
    # products of flexible dimensions, and those dimensions' (M, N, K) granularity; () where it is absent
    cm2_invocations: tuple = ()
    cm2_granularity: tuple = ()
    # the same for workgroup-scope bf16 x bf16 + f32 products (matmul_cm2's bf16 builds), where
    # the device also offers VK_KHR_shader_bfloat16's cooperative matrices (bf16_lacks == "")
    cm2_bf16_invocations: tuple = ()
    cm2_bf16_granularity: tuple = ()
    # VK_NV_cooperative_matrix2's row reductions and conversions between uses on subgroup-scope
    # matrices (the attn_cm2 kernels)
    cm2_fragment_ops: bool = False
    # VK_KHR_cooperative_matrix: the sizes n of its n x n x n f16 x f16 + f32 subgroup products
    # (the attention kernels' fragments), and what those kernels ask of subgroups and shared memory
    coopmat_khr_sizes: tuple = ()
    subgroup_size: int = 0
    subgroup_shuffle: bool = False   # subgroupShuffleXor in compute shaders
    shared_memory: int = 0           # maxComputeSharedMemorySize, bytes
    storage16: bool = False          # storageBuffer16BitAccess: bf16 storage (the `bf16` shader builds)
    # VK_KHR_shader_bfloat16 with bf16 cooperative matrices: the sizes n of its n x n x n
    # bf16 x bf16 + f32 subgroup products (the bf16 GEMM builds), and what is missing where
    # there are none ("" where they are offered)
    bf16_coopmat_sizes: tuple = ()
    bf16_lacks: str = "no VK_KHR_shader_bfloat16"

    @property
    def is_gpu(self) -> bool:
        return self.type in ("discrete", "integrated")

    def __str__(self) -> str:
        return f"{self.name} ({self.type})"


@attrs.frozen
class DeviceCaps:
    """What lowerings pick kernels by: the device's name (its kernel tables'
    family), its storage-buffer bindings and its cooperative-matrix products,
    as DeviceInfo names them. A dry run without a device has the defaults: no
    name, the default tables, no cooperative matrices, no binding limit."""
    name: str = ""
    storage_buffers: int = 0
    coopmat_f16: bool = False
    coopmat_khr_f16: bool = False
    cm2_invocations: tuple = ()
    cm2_granularity: tuple = ()
    cm2_bf16_invocations: tuple = ()
    cm2_bf16_granularity: tuple = ()
    cm2_fragment_ops: bool = False
    coopmat_khr_sizes: tuple = ()
    subgroup_size: int = 0
    subgroup_shuffle: bool = False
    shared_memory: int = 0
    bf16_coopmat_sizes: tuple = ()
    bf16_lacks: str = "no VK_KHR_shader_bfloat16"

    @classmethod
    def of(cls, info: DeviceInfo | None) -> DeviceCaps:
        """The capabilities `info` lists; the defaults for None."""
        if info is None:
            return cls()
        return cls(**{f.name: getattr(info, f.name) for f in attrs.fields(cls)})

    @property
    def described(self) -> str:
        return self.name or "this device"


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


COOPMAT_EXT = "VK_NV_cooperative_matrix"   # what glslc's GL_NV_cooperative_matrix shaders need
_F16, _F32, _SUBGROUP = 0, 1, 3            # VkComponentTypeNV / VkScopeNV values (the binding leaves them None)
COOP_SHARED_BYTES = 40960                  # matmul_coop's shared tiles (two 128x32 f16 buffers per operand, padded)


KHR_COOPMAT_EXT = "VK_KHR_cooperative_matrix"


def coopmat_f16(vk, physical, exts: set[str]) -> bool:
    """The device runs matmul_coop: the NV cooperative-matrix extension, its
    feature, and a 16x16x16 f16 x f16 + f32 shape in subgroup scope."""
    return 16 in _sizes(vk, physical, exts, COOPMAT_EXT, "NV")


def coopmat_khr_sizes(vk, physical, exts: set[str]) -> tuple:
    """coopmat_f16_sizes on VK_KHR_cooperative_matrix, () where it is absent."""
    return _sizes(vk, physical, exts, KHR_COOPMAT_EXT, "KHR")


def _sizes(vk, physical, exts: set[str], ext: str, kind: str) -> tuple:
    """A query the binding cannot make counts as none (the plain kernels run)."""
    if ext not in exts:
        return ()
    try:
        return coopmat_f16_sizes(vk, physical, kind)
    except Exception:  # noqa: BLE001 - an optional capability must never stop device discovery
        return ()


def coopmat_f16_sizes(vk, physical, kind: str = "KHR", operand: int = _F16) -> tuple:
    """The sizes n of the n x n x n f16 x f16 + f32 subgroup products the
    extension `kind` ("NV" or "KHR") offers, with its feature; () if none.
    operand=BF16: those of bf16 x bf16 + f32 (KHR only)."""
    # glslc's cooperative-matrix SPIR-V declares the VulkanMemoryModel capability
    # and its barriers take device scope, so the device must offer (and the device
    # creation enable) both of those features too
    memory_model = vk.VkPhysicalDeviceVulkanMemoryModelFeatures()
    feat = getattr(vk, f"VkPhysicalDeviceCooperativeMatrixFeatures{kind}")(pNext=memory_model)
    f2 = vk.VkPhysicalDeviceFeatures2(pNext=feat)
    vk.vkGetPhysicalDeviceFeatures2(physical, vk.ffi.addressof(f2))
    if not (feat.cooperativeMatrix and memory_model.vulkanMemoryModel and memory_model.vulkanMemoryModelDeviceScope):
        return ()
    name = f"vkGetPhysicalDeviceCooperativeMatrixProperties{kind}"
    raw = vk.lib.vkGetInstanceProcAddr(instance().handle, name.encode())
    if raw == vk.ffi.NULL:
        return ()
    # called directly: the binding's wrapper hands the driver structs without their sType
    query = vk.ffi.cast(f"PFN_{name}", raw)
    count = vk.ffi.new("uint32_t*")
    if query(physical, count, vk.ffi.NULL) != vk.VK_SUCCESS or count[0] == 0:
        return ()
    props = vk.ffi.new(f"VkCooperativeMatrixProperties{kind}[]", count[0])
    for i in range(count[0]):
        props[i].sType = getattr(vk, f"VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_{kind}")
    if query(physical, count, props) != vk.VK_SUCCESS:
        return ()
    result = "DType" if kind == "NV" else "ResultType"
    return tuple(sorted({p.MSize for p in props[0:count[0]]
                         if p.MSize == p.NSize == p.KSize
                         and (p.AType, p.BType, p.CType, getattr(p, result), p.scope)
                         == (operand, operand, _F32, _F32, _SUBGROUP)}))


BF16_EXT = "VK_KHR_shader_bfloat16"
BF16_FEATURES_STYPE = 1000141000   # VkPhysicalDeviceShaderBfloat16FeaturesKHR (newer than the binding)
BF16 = 1000141000                  # VK_COMPONENT_TYPE_BFLOAT16_KHR
BF16_FEATURES = ("shaderBFloat16Type", "shaderBFloat16DotProduct", "shaderBFloat16CooperativeMatrix")


def bf16_features(vk, physical) -> dict[str, bool]:
    """VkPhysicalDeviceShaderBfloat16FeaturesKHR, by name."""
    raw = RawStruct(vk, BF16_FEATURES_STYPE, len(BF16_FEATURES))
    f2 = vk.VkPhysicalDeviceFeatures2(pNext=raw.ptr)
    vk.vkGetPhysicalDeviceFeatures2(physical, vk.ffi.addressof(f2))
    return {name: bool(raw[i]) for i, name in enumerate(BF16_FEATURES)}


def bf16_coopmat(vk, physical, exts: set[str], storage16: bool) -> tuple[tuple, str]:
    """(sizes n of the n x n x n bf16 x bf16 + f32 subgroup products, what is
    missing where there are none: "" where they are offered). A query the
    binding cannot make counts as absent."""
    if BF16_EXT not in exts:
        return (), f"no {BF16_EXT}"
    if KHR_COOPMAT_EXT not in exts:
        return (), f"no {KHR_COOPMAT_EXT}"
    if not storage16:
        return (), "no 16-bit storage (storageBuffer16BitAccess)"
    try:
        have = bf16_features(vk, physical)
        missing = [n for n in ("shaderBFloat16Type", "shaderBFloat16CooperativeMatrix") if not have[n]]
        if missing:
            return (), f"{BF16_EXT} without {' and '.join(missing)}"
        sizes = coopmat_f16_sizes(vk, physical, "KHR", BF16)
    except Exception:  # noqa: BLE001 - an optional capability must never stop device discovery
        return (), f"{BF16_EXT}'s features could not be read"
    return (sizes, "") if 16 in sizes else (sizes, "no 16x16x16 bf16 x bf16 + f32 cooperative-matrix product")


CM2_EXTS = (KHR_COOPMAT_EXT, "VK_NV_cooperative_matrix2")   # what matmul_cm2's SPIR-V needs
# the binding (Vulkan headers 1.3.275) predates VK_NV_cooperative_matrix2: its structs are built by hand
CM2_FEATURES_STYPE = 1000593000   # VkPhysicalDeviceCooperativeMatrix2FeaturesNV
CM2_FLEX_STYPE = 1000593001       # VkCooperativeMatrixFlexibleDimensionsPropertiesNV
# VkPhysicalDeviceCooperativeMatrix2FeaturesNV's VkBool32s, in order
CM2_FEATURES = ("workgroupScope", "flexibleDimensions", "reductions", "conversions", "perElementOperations",
                "tensorAddressing", "blockLoads")
CM2_NEEDED = ("workgroupScope", "flexibleDimensions", "tensorAddressing")
CM2_FRAGMENT_OPS = ("reductions", "conversions")   # what the attn_cm2 kernels need of it
_WORKGROUP = 2                    # VkScopeKHR


class RawStruct:
    """A Vulkan struct the binding has no type for: sType, pNext, then 32-bit
    fields, in memory the binding can chain (pass .ptr as a pNext)."""

    HEADER_WORDS = 4   # sType, padding, the 8-byte pNext

    def __init__(self, vk, stype: int, fields: int, pnext=None):
        self.vk = vk
        self.words = vk.ffi.new("uint32_t[]", self.HEADER_WORDS + fields)
        self.words[0] = stype
        self._next = pnext   # kept alive with this struct
        if pnext is not None:
            target = vk.ffi.addressof(pnext) if vk.ffi.typeof(pnext).kind == "struct" else pnext
            vk.ffi.cast("void**", self.words + 2)[0] = vk.ffi.cast("void*", target)

    @property
    def ptr(self):
        return self.vk.ffi.cast("void*", self.words)

    def __getitem__(self, i: int) -> int:
        return int(self.words[self.HEADER_WORDS + i])

    def __setitem__(self, i: int, value: int) -> None:
        self.words[self.HEADER_WORDS + i] = value


def cm2_f16(vk, physical, exts: set[str], operand: int = _F16) -> tuple[tuple, tuple]:
    """(workgroup sizes, (M, N, K) granularity) for matmul_cm2 on this device, or
    ((), ()) where the extensions, features or an f16 x f16 + f32 workgroup-scope
    shape are missing (operand=BF16: bf16 x bf16 + f32, its bf16 builds). A query
    the binding cannot make counts as absent."""
    try:
        return ((), ()) if cm2_lacks(vk, physical, exts) else cm2_f16_query(vk, physical, operand)
    except Exception:  # noqa: BLE001 - an optional capability must never stop device discovery
        return (), ()


def cm2_features(vk, physical) -> dict[str, bool]:
    """VkPhysicalDeviceCooperativeMatrix2FeaturesNV, and KHR's cooperativeMatrix and the
    Vulkan memory model (the SPIR-V declares it), by name."""
    memory_model = vk.VkPhysicalDeviceVulkanMemoryModelFeatures()
    khr = vk.VkPhysicalDeviceCooperativeMatrixFeaturesKHR(pNext=memory_model)
    nv2 = RawStruct(vk, CM2_FEATURES_STYPE, len(CM2_FEATURES), pnext=khr)
    f2 = vk.VkPhysicalDeviceFeatures2(pNext=nv2.ptr)
    vk.vkGetPhysicalDeviceFeatures2(physical, vk.ffi.addressof(f2))
    out = {name: bool(nv2[i]) for i, name in enumerate(CM2_FEATURES)}
    out.update(cooperativeMatrix=bool(khr.cooperativeMatrix), vulkanMemoryModel=bool(memory_model.vulkanMemoryModel))
    return out


def cm2_lacks(vk, physical, exts: set[str]) -> list[str]:
    """The extensions, else the features, that matmul_cm2 needs and the device lacks."""
    missing = [e for e in CM2_EXTS if e not in exts]
    if missing:
        return missing
    have = cm2_features(vk, physical)
    return [n for n in (*CM2_NEEDED, "cooperativeMatrix", "vulkanMemoryModel") if not have[n]]


def cm2_fragment_ops(vk, physical, exts: set[str]) -> bool:
    """The device offers VK_NV_cooperative_matrix2's reductions and conversions (with
    VK_KHR_cooperative_matrix and the Vulkan memory model). A query the binding cannot
    make counts as absent."""
    if any(e not in exts for e in CM2_EXTS):
        return False
    try:
        have = cm2_features(vk, physical)
    except Exception:  # noqa: BLE001 - an optional capability must never stop device discovery
        return False
    return all(have[n] for n in (*CM2_FRAGMENT_OPS, "cooperativeMatrix", "vulkanMemoryModel"))


def cm2_f16_query(vk, physical, operand: int = _F16) -> tuple[tuple, tuple]:
    raw = vk.lib.vkGetInstanceProcAddr(instance().handle,
                                       b"vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV")
    if raw == vk.ffi.NULL:
        return (), ()
    query = vk.ffi.cast("VkResult (*)(VkPhysicalDevice, uint32_t *, void *)", raw)
    count = vk.ffi.new("uint32_t*")
    if query(physical, count, vk.ffi.NULL) != vk.VK_SUCCESS or count[0] == 0:
        return (), ()
    size = 14   # words: sType, pad, pNext, then M/N/K granularity, A/B/C/Result types, saturating, scope, invocations
    props = vk.ffi.new("uint32_t[]", size * count[0])
    for i in range(count[0]):
        props[i * size] = CM2_FLEX_STYPE
    if query(physical, count, props) != vk.VK_SUCCESS:
        return (), ()
    rows = [tuple(int(props[i * size + 4 + j]) for j in range(10)) for i in range(count[0])]
    ok = [r for r in rows if r[3:8] == (operand, operand, _F32, _F32, 0) and r[8] == _WORKGROUP]
    if not ok:
        return (), ()
    granularity = tuple(max(r[j] for r in ok) for j in range(3))
    return tuple(sorted({r[9] for r in ok})), granularity


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
    sub = vk.VkPhysicalDeviceSubgroupProperties(pNext=m3)
    p2 = vk.VkPhysicalDeviceProperties2(pNext=sub)
    vk.vkGetPhysicalDeviceProperties2(physical, vk.ffi.addressof(p2))
    family = compute_family(vk, physical)
    f16_ok = bool(s16.storageBuffer16BitAccess and f16.shaderFloat16)
    shared = int(props.limits.maxComputeSharedMemorySize)
    khr_sizes = coopmat_khr_sizes(vk, physical, exts) if f16_ok else ()
    storage16 = bool(s16.storageBuffer16BitAccess)
    bf16_sizes, bf16_lacks = bf16_coopmat(vk, physical, exts, storage16)
    if not bf16_lacks and shared < COOP_SHARED_BYTES:
        bf16_lacks = f"{shared} bytes of shared memory (the bf16 GEMM takes {COOP_SHARED_BYTES})"
    return DeviceInfo(
        index=index, name=str(props.deviceName), type=DEVICE_TYPES.get(props.deviceType, "other"),
        memory=int(max(local)), f16=f16_ok,
        coopmat=bool({"VK_KHR_cooperative_matrix", "VK_NV_cooperative_matrix"} & exts),
        api_version=_version(props.apiVersion), driver=_version(props.driverVersion),
        timestamps=bool(family and family[1] > 0 and props.limits.timestampPeriod > 0),
        max_allocation=int(m3.maxMemoryAllocationSize),
        max_storage_range=int(props.limits.maxStorageBufferRange),
        max_groups=tuple(int(x) for x in props.limits.maxComputeWorkGroupCount),
        storage_buffers=int(props.limits.maxPerStageDescriptorStorageBuffers),
        coopmat_f16=f16_ok and shared >= COOP_SHARED_BYTES and coopmat_f16(vk, physical, exts),
        coopmat_khr_f16=shared >= COOP_SHARED_BYTES and 16 in khr_sizes,
        **_cm2_fields(vk, physical, exts, f16_ok, bf16=not bf16_lacks),
        coopmat_khr_sizes=khr_sizes, subgroup_size=int(sub.subgroupSize),
        subgroup_shuffle=bool(sub.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT
                              and sub.supportedOperations & vk.VK_SUBGROUP_FEATURE_SHUFFLE_BIT),
        shared_memory=shared, storage16=storage16, bf16_coopmat_sizes=bf16_sizes, bf16_lacks=bf16_lacks)


def _cm2_fields(vk, physical, exts, f16_ok: bool, bf16: bool) -> dict:
    invocations, granularity = cm2_f16(vk, physical, exts) if f16_ok else ((), ())
    bf16_invocations, bf16_granularity = cm2_f16(vk, physical, exts, BF16) if bf16 else ((), ())
    return {"cm2_invocations": invocations, "cm2_granularity": granularity,
            "cm2_bf16_invocations": bf16_invocations, "cm2_bf16_granularity": bf16_granularity,
            "cm2_fragment_ops": f16_ok and cm2_fragment_ops(vk, physical, exts)}


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
