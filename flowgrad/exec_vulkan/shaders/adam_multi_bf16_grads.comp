// variants: f32
#version 450
// adam_multi_vec with bf16 gradients beside f32 params and moments (mixed precision in bf16)
#define FG_VECTORS 1
#define GRADS_BF16 1
#include "adam_multi.glsl"
