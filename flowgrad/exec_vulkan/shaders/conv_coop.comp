#version 450
// matmul_coop's cooperative-matrix tile (the same defines; a test compares them) over
// conv_gemm.glsl's operands, f16 storage only.
#define COOP_NV 1
#define WGM 2
#define WGN 4
#define FM 4
#define FN 2
#define BK 32
#define F16 1
#define GEMM_RUN 8
#include "conv_gemm.glsl"
#include "matmul_coop.glsl"
