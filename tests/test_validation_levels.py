"""Validation messages that only say the layer predates an extension the device
offers are warnings; every other validation error stays an error. The texts
are the ones bookworm's layer (1.3.239) printed on an H200 for matmul_cm2."""
from __future__ import annotations

from flowgrad.exec_vulkan.instance import message_level

UNKNOWN_STRUCT = ("Validation Error: [ VUID-VkDeviceCreateInfo-pNext-pNext ] Object 0: VK_NULL_HANDLE, "
                  "type = VK_OBJECT_TYPE_DEVICE; | MessageID = 0x901f59ec | vkCreateDevice: pCreateInfo->pNext "
                  "chain includes a structure with unknown VkStructureType (1000593000); Allowed structures are "
                  "[VkDeviceDeviceMemoryReportCreateInfoEXT, VkPhysicalDeviceCooperativeMatrixFeaturesNV]")
UNKNOWN_CAPABILITY = ("Validation Error: [ UNASSIGNED-CoreValidation-Shader-InconsistentSpirv ] Object 0: "
                      "handle = 0x3fc92d60, type = VK_OBJECT_TYPE_DEVICE; | MessageID = 0x6bbb14 | SPIR-V module "
                      "not valid: Invalid capability operand: 5433")
UNKNOWN_EXTENSION = ("Validation Error: [ VUID-VkShaderModuleCreateInfo-pCode-04146 ] Object 0: handle = "
                     "0x39a98e50, type = VK_OBJECT_TYPE_DEVICE; | MessageID = 0xd80a42ae | vkCreateShaderModule(): "
                     "A SPIR-V Extension (SPV_KHR_cooperative_matrix) was declared that is not supported by Vulkan.")
UNNAMED_CAPABILITY = ("Validation Error: [ VUID-VkShaderModuleCreateInfo-pCode-01090 ] Object 0: handle = "
                      "0x14cc3810, type = VK_OBJECT_TYPE_DEVICE; | MessageID = 0x2c00a3d6 | vkCreateShaderModule(): "
                      "A SPIR-V Capability (Unhandled OpCapability) was declared that is not supported by Vulkan.")


def test_messages_of_a_layer_older_than_cooperative_matrix_2_are_warnings():
    assert message_level(True, UNKNOWN_STRUCT) == "warning"
    assert message_level(True, UNKNOWN_CAPABILITY) == "warning"
    # VK_KHR_cooperative_matrix's features struct and SPIR-V capability, which that layer predates too
    assert message_level(True, UNKNOWN_STRUCT.replace("1000593000", "1000506000")) == "warning"
    assert message_level(True, UNKNOWN_CAPABILITY.replace("5433", "6022")) == "warning"
    assert message_level(True, UNNAMED_CAPABILITY) == "warning"
    assert message_level(True, UNKNOWN_EXTENSION) == "warning"


def test_other_validation_errors_stay_errors():
    assert message_level(True, UNKNOWN_STRUCT.replace("1000593000", "1000201000")) == "error"
    assert message_level(True, UNKNOWN_CAPABILITY.replace("5433", "5345")) == "error"
    assert message_level(True, "Validation Error: [ VUID-vkCmdDispatch-None-08114 ] descriptor not updated") == "error"
    # a capability the layer knows by name but Vulkan does not take is a real error
    assert message_level(True, UNNAMED_CAPABILITY.replace("Unhandled OpCapability", "Kernel")) == "error"
    assert message_level(True, UNKNOWN_EXTENSION.replace("SPV_KHR_cooperative_matrix", "SPV_INTEL_foo")) == "error"
    assert message_level(False, UNKNOWN_CAPABILITY) == "warning"
    assert message_level(False, "a performance warning") == "warning"
