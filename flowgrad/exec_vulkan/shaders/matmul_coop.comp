#version 450
// 128x128 tile: 2x4 subgroups of 4x2 fragments, 32 deep per step (see matmul_coop.glsl).
#define COOP_NV 1
#define WGM 2
#define WGN 4
#define FM 4
#define FN 2
#define BK 32
#include "matmul_coop.glsl"
