#version 450
// Attention backward, dq pass, head widths up to 256 (see attn_bwd_dq.glsl).
#define MAXD 256
#include "attn_bwd_dq.glsl"
