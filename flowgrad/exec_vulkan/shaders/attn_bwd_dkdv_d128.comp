#version 450
// Attention backward, dk/dv pass, head widths up to 128 (see attn_bwd_dkdv.glsl).
#define MAXD 128
#include "attn_bwd_dkdv.glsl"
