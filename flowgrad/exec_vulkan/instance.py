"""The Vulkan loader and the process's VkInstance, with the Khronos validation
layer and its messages when FLOWGRAD_VK_VALIDATION=1.

Every Vulkan failure becomes a DeviceError with a message saying what was
being done (vk_errors); nothing here may abort the interpreter. cffi structs
that hold a string or a pointer are kept in local variables until the call
that reads them returns (a struct passed inline can be freed before Vulkan
reads it): this holds for every module that calls Vulkan."""
from __future__ import annotations

import contextlib
import os
import re
import threading

from flowgrad.errors import DeviceError

VALIDATION_ENV = "FLOWGRAD_VK_VALIDATION"   # "1": Khronos validation layer + message collection
VALIDATION_LAYER = "VK_LAYER_KHRONOS_validation"

# A layer older than an extension reports that extension's structures and SPIR-V
# capabilities as unknown (Debian bookworm's 1.3.239 predates
# VK_KHR_cooperative_matrix and VK_NV_cooperative_matrix2, which matmul_cm2
# uses). Such a message says the layer is old, not that the call is wrong: it
# is kept as a warning.
PREDATES_LAYER = (
    # VkPhysicalDeviceCooperativeMatrixFeaturesKHR (1000506000) and
    # VkPhysicalDeviceCooperativeMatrix2FeaturesNV (1000593000) in vkCreateDevice's chain
    re.compile(r"VUID-VkDeviceCreateInfo-pNext-pNext.*unknown VkStructureType \((1000506000|1000593000)\)", re.S),
    # SPV_NV_cooperative_matrix2 / SPV_NV_tensor_addressing capabilities (5430-5439), and
    # SPV_KHR_cooperative_matrix's CooperativeMatrixKHR (6022), in a module or where a
    # pipeline specializes one
    re.compile(r"(InconsistentSpirv|VUID-VkPipelineShaderStageCreateInfo-module-parameter)"
               r".*Invalid capability operand: (543\d|6022)\b", re.S),
    # its spirv-opt failing to specialize a module it cannot read (a module with those capabilities
    # and specialization constants): no verdict on the module, whose checks above ran at its creation
    re.compile(r"VUID-VkPipelineShaderStageCreateInfo-pSpecializationInfo-06719.*"
               r"attempted to apply specialization constants with spirv-opt but failed", re.S),
    # a capability the layer cannot even name (it names every one it knows)
    re.compile(r"VUID-VkShaderModuleCreateInfo-pCode-01090.*\(Unhandled OpCapability\)", re.S),
    # those extensions' SPIR-V extensions, which the layer does not know Vulkan takes
    re.compile(r"VUID-VkShaderModuleCreateInfo-pCode-04146.*SPIR-V Extension "
               r"\((SPV_KHR_cooperative_matrix|SPV_NV_cooperative_matrix2|SPV_NV_tensor_addressing)\)", re.S),
)

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


def load_vulkan():
    try:
        import vulkan
    except (ImportError, OSError) as e:
        raise DeviceError(f"the Vulkan loader could not be loaded: {e}",
                          hint="install libvulkan1 and a driver (Debian: mesa-vulkan-drivers for lavapipe)") from None
    return vulkan


@contextlib.contextmanager
def vk_errors(what: str):
    """Turn any exception the `vulkan` binding raises into a DeviceError."""
    vk = load_vulkan()
    try:
        yield vk
    except (vk.VkError, vk.VkException, vk.ProcedureNotFoundError, vk.ExtensionNotSupportedError) as e:
        name = type(e).__name__
        raise DeviceError(f"{what} failed: {_VK_ERRORS.get(name, name)}") from None


class Instance:
    """The process's VkInstance (one, created on first use). With
    FLOWGRAD_VK_VALIDATION=1 it enables the Khronos validation layer and
    collects its messages; errors can be read with validation_errors()."""

    def __init__(self):
        vk = load_vulkan()
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
        # 1.3: the cooperative-matrix-2 GEMM is SPIR-V 1.6 (a device of an older version runs at its own)
        app = vk.VkApplicationInfo(pApplicationName="flowgrad", applicationVersion=1, pEngineName="flowgrad",
                                   engineVersion=1, apiVersion=vk.VK_MAKE_VERSION(1, 3, 0))
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
            vk = load_vulkan()
            text = vk.ffi.string(data.pMessage).decode("utf-8", "replace") if data.pMessage else "?"
            level = message_level(bool(severity & vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT), text)
            self.messages.append((level, text))
        except Exception as e:  # noqa: BLE001 - a callback must never raise into the driver
            self.messages.append(("error", f"(could not read a validation message: {e})"))
        return 0


def message_level(error: bool, text: str) -> str:
    """"error" for a validation error the layer can judge, else "warning"."""
    return "error" if error and not any(p.search(text) for p in PREDATES_LAYER) else "warning"


_INSTANCE: Instance | None = None
_CREATING = threading.Lock()   # two threads asking at once get the same instance


def instance() -> Instance:
    global _INSTANCE
    with _CREATING:
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
