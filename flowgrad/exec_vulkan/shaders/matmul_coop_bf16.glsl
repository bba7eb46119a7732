// compiler: glslc-bf16 (GL_EXT_bfloat16 needs glslang 16 or newer)
#version 450
// matmul_coop.glsl's bf16 builds on VK_KHR_cooperative_matrix and VK_KHR_shader_bfloat16: bf16
// operands and result, f32 accumulation; one build per tile and operand layout, the defines
// from flowgrad/exec_vulkan/matmul_coop.py.
#define BF16 1
#include "matmul_coop.glsl"
