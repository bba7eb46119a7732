#version 450
// matmul_coop with its shared tiles as f16 scalars (see matmul_coop.glsl).
#define WGM 2
#define WGN 4
#define FM 4
#define FN 2
#define BK 32
#define SHALF 1
#include "matmul_coop.glsl"
