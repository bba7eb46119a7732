#version 450
// matmul_128x128_k8's tile (the same defines; a test compares them) over conv_gemm.glsl's operands.
#define BM 128
#define BN 128
#define BK 8
#define TM 8
#define TN 8
#include "conv_gemm.glsl"
#include "matmul_tiled.glsl"
