#version 450
// Attention backward, dq pass, head widths up to 128 (see attn_bwd_dq.glsl).
#define MAXD 128
#include "attn_bwd_dq.glsl"
