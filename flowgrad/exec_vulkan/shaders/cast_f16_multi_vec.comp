// variants: f32 bf16
#version 450
// cast_f16_multi.glsl moving 16-byte vectors (FG_VECTORS)
#define FG_VECTORS 1
#include "cast_f16_multi.glsl"
