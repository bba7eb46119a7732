// variants: f32 f16 bf16
#version 450
// fused_map.glsl over contiguous inputs in 16-byte vectors (FG_VECTORS)
#define FG_VECTORS 1
#include "fused_map.glsl"
