#version 450
// 128x256 tile: 2x4 subgroups of 4x4 fragments, 32 deep per step, one buffer (see matmul_coop.glsl).
#define WGM 2
#define WGN 4
#define FM 4
#define FN 4
#define BK 32
#define NBUF 1
#include "matmul_coop.glsl"
