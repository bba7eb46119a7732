// variants: f32
#version 450
// adam_multi.glsl moving 16-byte vectors (FG_VECTORS)
#define FG_VECTORS 1
#include "adam_multi.glsl"
