// compiler: glslc-2025 (GL_KHR_cooperative_matrix needs glslang 14 or newer)
#version 450
// matmul_coop's tile on VK_KHR_cooperative_matrix (see matmul_coop.glsl).
#define WGM 2
#define WGN 4
#define FM 4
#define FN 2
#define BK 32
#include "matmul_coop.glsl"
