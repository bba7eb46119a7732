#version 450
// 128x128 output tile, 8 deep per step, 8x8 outputs per invocation (see matmul_tiled.glsl).
#define BM 128
#define BN 128
#define BK 8
#define TM 8
#define TN 8
#include "matmul_tiled.glsl"
