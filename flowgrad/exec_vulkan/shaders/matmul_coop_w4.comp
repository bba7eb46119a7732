#version 450
// 128x128 tile: 2x2 subgroups of 4x4 fragments, 32 deep per step (see matmul_coop.glsl).
#define WGM 2
#define WGN 2
#define FM 4
#define FN 4
#define BK 32
#include "matmul_coop.glsl"
