#version 450
// Attention backward, dq pass, head widths up to 32 (see attn_bwd_dq.glsl).
#define MAXD 32
#include "attn_bwd_dq.glsl"
