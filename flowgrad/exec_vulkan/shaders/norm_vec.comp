// variants: f32 f16 bf16
#version 450
// norm.glsl with the forward in 16-byte vectors (modes 10, 11) and subgroup row sums
#define FG_SUBGROUP 1
#define FG_VECTORS 1
#include "norm.glsl"
