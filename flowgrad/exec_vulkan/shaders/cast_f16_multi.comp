// variants: f32 bf16
#version 450
#include "cast_f16_multi.glsl"
