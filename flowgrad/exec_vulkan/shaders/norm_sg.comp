// variants: f32 f16 bf16
#version 450
// norm.glsl with its row sums over subgroup shuffles (devices with subgroupShuffleXor)
#define FG_SUBGROUP 1
#include "norm.glsl"
