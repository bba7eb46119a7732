#version 450
// 128x256 tile: 2x4 subgroups of 4x4 fragments, 16 deep per step (see matmul_coop.glsl).
#define WGM 2
#define WGN 4
#define FM 4
#define FN 4
#define BK 16
#define NBUF 2
#include "matmul_coop.glsl"
