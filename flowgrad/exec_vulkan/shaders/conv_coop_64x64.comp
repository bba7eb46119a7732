#version 450
// A quarter of matmul_coop's tile over conv_gemm.glsl's operands (f16 storage only): 64x64,
// 2x2 subgroups of 2x2 fragments, 32 deep per step; half the accumulators per invocation
// and four times the workgroups of conv_coop.
#define COOP_NV 1
#define WGM 2
#define WGN 2
#define FM 2
#define FN 2
#define BK 32
#define F16 1
#define GEMM_RUN 8
#include "conv_gemm.glsl"
#include "matmul_coop.glsl"
