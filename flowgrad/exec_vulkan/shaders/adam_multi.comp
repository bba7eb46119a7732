// variants: f32 f16 bf16
#version 450
#include "adam_multi.glsl"
