// variants: f32 f16 bf16
#version 450
// 64x64 output tile, 16 deep per step, 4x4 outputs per invocation (see matmul_tiled.glsl).
#define BM 64
#define BN 64
#define BK 16
#define TM 4
#define TN 4
#include "matmul_tiled.glsl"
