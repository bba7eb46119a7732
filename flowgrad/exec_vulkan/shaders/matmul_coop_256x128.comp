#version 450
// 256x128 tile: 4x2 subgroups of 4x4 fragments, 16 deep per step (see matmul_coop.glsl).
#define WGM 4
#define WGN 2
#define FM 4
#define FN 4
#define BK 16
#define NBUF 2
#include "matmul_coop.glsl"
