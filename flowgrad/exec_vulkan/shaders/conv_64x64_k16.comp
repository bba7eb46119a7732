// variants: f32 f16 bf16
#version 450
// matmul_64x64_k16's tile (the same defines; a test compares them) over conv_gemm.glsl's operands.
#define BM 64
#define BN 64
#define BK 16
#define TM 4
#define TN 4
#include "conv_gemm.glsl"
#include "matmul_tiled.glsl"
