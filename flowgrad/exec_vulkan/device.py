"""An opened Vulkan device: one compute queue, a command pool, a pipeline
cache saved across runs, memory types, pipelines, and submission.

A process has one Device per physical device, which every session on it
shares, from any thread: its queue and fence, its command pool (and the
command buffers recorded from it), its pipelines and its buffer pool are
used under `lock`, one thread at a time (Vulkan leaves that synchronisation
to the application, and lavapipe crashes without it)."""
from __future__ import annotations

import atexit
import collections
import hashlib
import os
import threading
from pathlib import Path

import attrs

from flowgrad.errors import DeviceError
from flowgrad.exec_vulkan.buffers import Buffer, BufferPool, mib
from flowgrad.exec_vulkan.discovery import (BF16_EXT, BF16_FEATURES, BF16_FEATURES_STYPE, CM2_EXTS, CM2_FEATURES, CM2_FEATURES_STYPE, CM2_FRAGMENT_OPS, CM2_NEEDED,
                                            COOPMAT_EXT, KHR_COOPMAT_EXT, RawStruct, _extensions, compute_family, describe,
                                            features, physical_devices)
from flowgrad.exec_vulkan import submit
from flowgrad.exec_vulkan.instance import load_vulkan, vk_errors
from flowgrad.exec_vulkan.spirv import shader_info

STATS_EXT = "VK_KHR_pipeline_executable_properties"
PUSH_BYTES = 128                            # every pipeline layout has one 128-byte push range


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
        vk = load_vulkan()
        # re-entrant: a pipeline is built while a command buffer is encoded, a buffer made while one is acquired
        self.lock = threading.RLock()
        physicals = physical_devices()
        if not 0 <= index < len(physicals):
            raise DeviceError(f"no Vulkan device {index} ({len(physicals)} found)")
        self.physical = physicals[index]
        with vk_errors("reading device properties"):
            self.info = describe(vk, index, self.physical)
            props = vk.vkGetPhysicalDeviceProperties(self.physical)
            self.limits = props.limits
            self.min_align = int(props.limits.minStorageBufferOffsetAlignment)
            self.max_storage_range = int(props.limits.maxStorageBufferRange)
            self.max_groups = tuple(int(x) for x in props.limits.maxComputeWorkGroupCount)
            self.timestamp_period = float(props.limits.timestampPeriod)
            self.uuid = bytes(props.pipelineCacheUUID)
            self._mem = vk.vkGetPhysicalDeviceMemoryProperties(self.physical)
        family = compute_family(vk, self.physical)
        if family is None:
            raise DeviceError(f"{self.info.name} has no compute queue")
        self.family = family[0]
        self.handle = None
        self._fence = None
        self._fence_array = None           # the fence as the loader takes it (submit.py)
        self._abandoned_fences: list = []   # fences that timed out: never reused
        self.lost: str | None = None        # why the device can't be used any more, once it can't
        self.objects: collections.Counter = collections.Counter()   # live buffers and command buffers
        # FLOWGRAD_VK_PIPELINE_STATS=1: pipelines keep the driver's statistics (registers,
        # spills, shared memory), for tuning kernels; see pipeline_statistics
        self.capture_stats = (os.environ.get("FLOWGRAD_VK_PIPELINE_STATS") == "1"
                              and STATS_EXT in _extensions(vk, self.physical))
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
        _, s16, f16 = features(vk, self.physical)
        want_f16 = vk.VkPhysicalDeviceShaderFloat16Int8Features(shaderFloat16=f16.shaderFloat16)
        want_s16 = vk.VkPhysicalDevice16BitStorageFeatures(pNext=want_f16,
                                                           storageBuffer16BitAccess=s16.storageBuffer16BitAccess)
        # cooperative matrices only where matmul_coop, matmul_cm2 or the attention kernels can
        # use them (their feature structs are chained nowhere else: Debian's validation layer,
        # 1.3.239, rejects them)
        exts = []
        chain = want_s16
        bf16_coop = not self.info.bf16_lacks   # the bf16 GEMM builds (VK_KHR_shader_bfloat16)
        subgroup_coop = (self.info.coopmat_f16 or bool(self.info.coopmat_khr_sizes) or self.info.cm2_fragment_ops
                         or bf16_coop)
        cm2_products = bool(self.info.cm2_invocations or self.info.cm2_bf16_invocations)   # matmul_cm2's builds
        if subgroup_coop or cm2_products:
            # subgroup-scope kernels' barriers take device scope; matmul_cm2 has none
            chain = vk.VkPhysicalDeviceVulkanMemoryModelFeatures(
                pNext=chain, vulkanMemoryModel=1, vulkanMemoryModelDeviceScope=int(subgroup_coop))
        if self.info.coopmat_f16:
            exts.append(COOPMAT_EXT)
            chain = vk.VkPhysicalDeviceCooperativeMatrixFeaturesNV(pNext=chain, cooperativeMatrix=1)
        if self.info.coopmat_khr_sizes or cm2_products or self.info.cm2_fragment_ops or bf16_coop:
            exts.append(KHR_COOPMAT_EXT)
            chain = vk.VkPhysicalDeviceCooperativeMatrixFeaturesKHR(pNext=chain, cooperativeMatrix=1)
        if bf16_coop:
            exts.append(BF16_EXT)
            self._bf16_features = RawStruct(vk, BF16_FEATURES_STYPE, len(BF16_FEATURES), pnext=chain)
            for name in ("shaderBFloat16Type", "shaderBFloat16CooperativeMatrix"):
                self._bf16_features[BF16_FEATURES.index(name)] = 1
            chain = self._bf16_features.ptr
        # matmul_cm2: workgroup-scope matrices, flexible sizes, tensor loads; the attn_cm2
        # kernels: reductions and conversions
        cm2_wanted = ((CM2_NEEDED if cm2_products else ())
                      + (CM2_FRAGMENT_OPS if self.info.cm2_fragment_ops else ()))
        if cm2_wanted:
            exts += [e for e in CM2_EXTS if e not in exts]
            self._cm2_features = RawStruct(vk, CM2_FEATURES_STYPE, len(CM2_FEATURES), pnext=chain)
            for name in cm2_wanted:
                self._cm2_features[CM2_FEATURES.index(name)] = 1
            chain = self._cm2_features.ptr
        if self.capture_stats:
            exts.append(STATS_EXT)
            chain = vk.VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR(pNext=chain, pipelineExecutableInfo=1)
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
        vk = load_vulkan()
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
        vk = load_vulkan()
        want = (vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT | vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
                | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT)
        heaps = self._mem.memoryHeaps
        # only when the mappable device-local memory is the whole device-local heap (unified memory),
        # not a small BAR window of a discrete GPU
        return any((t.propertyFlags & want) == want and heaps[t.heapIndex].size >= self.info.memory
                   for _, t in self._types()) and self.info.type in ("cpu", "integrated", "virtual")

    def memory_type(self, kind: str, allowed_bits: int) -> tuple[int, bool]:
        """(memory type index, map it?) for kind "device", "upload" or "download"."""
        vk = load_vulkan()
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
                f"cannot allocate {mib(size)} on {self.info.name}: larger than the device allows "
                f"(largest allocation {mib(limit)}, device memory {mib(self.info.memory)})",
                hint="use a smaller batch or model, or a device with more memory")

    def buffer(self, nbytes: int, kind: str = "device") -> Buffer:
        if kind not in ("device", "upload", "download"):
            raise ValueError(f"buffer kind must be device, upload or download, got {kind!r}")
        self.check_usable()
        return Buffer(self, nbytes, kind)

    # -- pipelines

    def set_layout(self, n: int):
        """(descriptor set layout, pipeline layout) for n storage buffers + the push range."""
        with self.lock:
            return self._set_layout(n)

    def _set_layout(self, n: int):
        if n not in self._set_layouts:
            vk = load_vulkan()
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

    def pipeline(self, shader: str, variant: str | None = None, spec: tuple = ()) -> Pipeline:
        """spec: u32 values of the shader's specialization constants 0, 1, ...
        (the driver compiles each distinct tuple with them folded in)."""
        key = (shader, variant, spec)
        with self.lock:
            if key not in self.pipelines:
                self.pipelines[key] = self._build_pipeline(shader, variant, spec)
            return self.pipelines[key]

    def _build_pipeline(self, shader: str, variant: str | None, constants: tuple = ()) -> Pipeline:
        vk = load_vulkan()
        spec = shader_info(shader, variant)
        if variant == "f16" and not self.info.f16:
            raise DeviceError(f"{self.info.name} has no 16-bit storage / float16 support for shader {spec.name}")
        if variant == "bf16" and not self.info.storage16:
            raise DeviceError(f"{self.info.name} has no 16-bit storage (storageBuffer16BitAccess) for shader {spec.name}")
        set_layout, layout = self.set_layout(spec.bindings)
        code = spec.code
        module_info = vk.VkShaderModuleCreateInfo(codeSize=len(code), pCode=code)
        with vk_errors(f"loading shader {spec.name}"):
            module = vk.vkCreateShaderModule(self.handle, module_info, None)
        try:
            special = None
            if constants:
                entries = [vk.VkSpecializationMapEntry(constantID=i, offset=4 * i, size=4) for i in range(len(constants))]
                data = vk.ffi.new("uint32_t[]", list(constants))
                special = vk.VkSpecializationInfo(mapEntryCount=len(entries), pMapEntries=entries,
                                                  dataSize=4 * len(constants), pData=data)
            stage = vk.VkPipelineShaderStageCreateInfo(stage=vk.VK_SHADER_STAGE_COMPUTE_BIT, module=module,
                                                       pName="main", pSpecializationInfo=special)
            flags = vk.VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR if self.capture_stats else 0
            info = vk.VkComputePipelineCreateInfo(stage=stage, layout=layout, flags=flags)
            infos = [info]
            with vk_errors(f"building the compute pipeline for shader {spec.name}"):
                handle = vk.vkCreateComputePipelines(self.handle, self.pipeline_cache, 1, infos, None)[0]
        finally:
            vk.vkDestroyShaderModule(self.handle, module, None)
        return Pipeline(handle, layout, set_layout, spec.bindings)

    def pipeline_statistics(self, shader: str, variant: str | None = None) -> dict[str, float]:
        """The driver's statistics of one shader's pipeline ({name: value};
        NVIDIA's include the register count and spill bytes). Needs the
        device opened with FLOWGRAD_VK_PIPELINE_STATS=1 where the driver has
        VK_KHR_pipeline_executable_properties."""
        if not self.capture_stats:
            raise DeviceError(f"{self.info.name} was opened without pipeline statistics",
                              hint=f"set FLOWGRAD_VK_PIPELINE_STATS=1 (the driver needs {STATS_EXT})")
        vk = load_vulkan()
        props = vk.vkGetDeviceProcAddr(self.handle, "vkGetPipelineExecutablePropertiesKHR")
        stats = vk.vkGetDeviceProcAddr(self.handle, "vkGetPipelineExecutableStatisticsKHR")
        handle = self.pipeline(shader, variant).handle
        out = {}
        with vk_errors(f"reading the pipeline statistics of {shader}"):
            count = len(list(props(self.handle, vk.VkPipelineInfoKHR(pipeline=handle))))
            for index in range(count):
                info = vk.VkPipelineExecutableInfoKHR(pipeline=handle, executableIndex=index)
                for st in stats(self.handle, info):
                    kind, value = st.format, st.value
                    number = {vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR: value.b32,
                              vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR: value.i64,
                              vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR: value.u64,
                              vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_FLOAT64_KHR: value.f64}[kind]
                    out[st.name if count == 1 else f"{index}:{st.name}"] = number
        return out

    # -- submission

    def command_buffer(self):
        vk = load_vulkan()
        self.check_usable()
        info = vk.VkCommandBufferAllocateInfo(commandPool=self.command_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
                                              commandBufferCount=1)
        with self.lock, vk_errors("allocating a command buffer"):
            cmd = vk.vkAllocateCommandBuffers(self.handle, info)[0]
            self.objects["command_buffer"] += 1
        return cmd

    def free_command_buffer(self, cmd) -> None:
        with self.lock:
            if self.handle is not None:
                load_vulkan().vkFreeCommandBuffers(self.handle, self.command_pool, 1, [cmd])
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
        submit.submit_and_wait(self, submit.Submission(cmd), what)

    def wait_idle(self) -> None:
        with self.lock, vk_errors("waiting for the device"):
            load_vulkan().vkDeviceWaitIdle(self.handle)

    def __repr__(self) -> str:
        mode = "staging" if self.staging else "mapped"
        return f"<Device vulkan:{self.info.index} {self.info.name} ({self.info.type}, {mode})>"
