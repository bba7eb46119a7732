// variants: f32 f16
#version 450
// Attention forward for head widths up to 64 (see attn_fwd.glsl).
#define MAXD 64
#include "attn_fwd.glsl"
