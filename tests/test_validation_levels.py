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
# the same capability checked again where a pipeline specializes the module (bookworm's layer on Mesa
# 26's lavapipe, for matmul_coop's builds with an epilogue in specialization constants)
SPECIALIZED_CAPABILITY = ("Validation Error: [ VUID-VkPipelineShaderStageCreateInfo-module-parameter ] Object 0: "
                          "handle = 0x555593d1fa60, type = VK_OBJECT_TYPE_DEVICE; | MessageID = 0xfd71dc70 | "
                          "VkShaderModule 0x2f000000002f[] does not contain valid spirv for stage "
                          "VK_SHADER_STAGE_COMPUTE_BIT. Invalid capability operand: 6022")
# and its spirv-opt, which cannot read such a module, failing to specialize it
SPECIALIZE_FAILED = ("Validation Error: [ VUID-VkPipelineShaderStageCreateInfo-pSpecializationInfo-06719 ] Object 0: "
                     "handle = 0x5555687da080, type = VK_OBJECT_TYPE_DEVICE; | MessageID = 0x6002c3e1 | VkShaderModule "
                     "0x120000000012[] module (stage VK_SHADER_STAGE_COMPUTE_BIT) attempted to apply specialization "
                     "constants with spirv-opt but failed.")
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
    assert message_level(True, SPECIALIZED_CAPABILITY) == "warning"
    assert message_level(True, SPECIALIZE_FAILED) == "warning"


def test_other_validation_errors_stay_errors():
    assert message_level(True, UNKNOWN_STRUCT.replace("1000593000", "1000201000")) == "error"
    assert message_level(True, UNKNOWN_CAPABILITY.replace("5433", "5345")) == "error"
    assert message_level(True, "Validation Error: [ VUID-vkCmdDispatch-None-08114 ] descriptor not updated") == "error"
    # a capability the layer knows by name but Vulkan does not take is a real error
    assert message_level(True, UNNAMED_CAPABILITY.replace("Unhandled OpCapability", "Kernel")) == "error"
    assert message_level(True, UNKNOWN_EXTENSION.replace("SPV_KHR_cooperative_matrix", "SPV_INTEL_foo")) == "error"
    assert message_level(False, UNKNOWN_CAPABILITY) == "warning"
    assert message_level(True, SPECIALIZED_CAPABILITY.replace("6022", "5345")) == "error"
    assert message_level(False, "a performance warning") == "warning"
