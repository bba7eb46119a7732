// variants: f32 f16
#version 450
// Attention forward for head widths up to 32 (see attn_fwd.glsl).
#define MAXD 32
#include "attn_fwd.glsl"
