#version 450
// 128x128 tile: 2x2 subgroups of 4x4 fragments, 64 deep per step, one buffer (see matmul_coop.glsl).
#define WGM 2
#define WGN 2
#define FM 4
#define FN 4
#define BK 64
#define NBUF 1
#include "matmul_coop.glsl"
