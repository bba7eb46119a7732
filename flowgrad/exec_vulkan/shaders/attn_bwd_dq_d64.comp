#version 450
// Attention backward, dq pass, head widths up to 64 (see attn_bwd_dq.glsl).
#define MAXD 64
#include "attn_bwd_dq.glsl"
