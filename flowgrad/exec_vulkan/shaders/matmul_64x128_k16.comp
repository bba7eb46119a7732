// variants: f32 f16
#version 450
// 64x128 output tile, 16 deep per step, 4x8 outputs per invocation (see matmul_tiled.glsl).
#define BM 64
#define BN 128
#define BK 16
#define TM 4
#define TN 8
#include "matmul_tiled.glsl"
