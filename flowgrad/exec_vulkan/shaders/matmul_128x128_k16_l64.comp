#version 450
// matmul_128x128_k16's tile with 64 more invocations that do its loads (see LOADERS in matmul_tiled.glsl).
#define BM 128
#define BN 128
#define BK 16
#define TM 8
#define TN 8
#define PAD 0
#define LOADERS 64
#include "matmul_tiled.glsl"
