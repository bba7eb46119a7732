// compiler: glslc-2025 (GL_KHR_cooperative_matrix needs glslang 14 or newer)
#version 450
// matmul_coop on 8x8x8 products with subgroups of 8 (Mesa 26's lavapipe offers
// no other size): a 64x64 tile, 2x2 subgroups of 4x4 fragments, 32 deep per step.
#define FR 8
#define SG 8
#define WGM 2
#define WGN 2
#define FM 4
#define FN 4
#define BK 32
#include "matmul_coop.glsl"
