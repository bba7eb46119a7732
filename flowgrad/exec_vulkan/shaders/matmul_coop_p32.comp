#version 450
// matmul_coop.comp's tile storing split-K's partials in f32 (see matmul_coop.glsl).
#define COOP_NV 1
#define PARTS_F32 1
#define WGM 2
#define WGN 4
#define FM 4
#define FN 2
#define BK 32
#include "matmul_coop.glsl"
