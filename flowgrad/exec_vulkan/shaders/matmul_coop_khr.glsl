// compiler: glslc-2025 (GL_KHR_cooperative_matrix needs glslang 14 or newer)
#version 450
// matmul_coop.glsl on VK_KHR_cooperative_matrix: one build per tile and operand layout,
// the defines from flowgrad/exec_vulkan/matmul_coop.py.
#include "matmul_coop.glsl"
