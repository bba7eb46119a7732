#version 450
// 128x128 output tile, 16 deep per step, 8x8 outputs per invocation (see matmul_tiled.glsl).
#define BM 128
#define BN 128
#define BK 16
#define TM 8
#define TN 8
#define PAD 0                   // unpadded: two buffers fit in 32 KiB of shared memory
#include "matmul_tiled.glsl"
