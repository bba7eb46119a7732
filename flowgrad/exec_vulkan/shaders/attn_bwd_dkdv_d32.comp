#version 450
// Attention backward, dk/dv pass, head widths up to 32 (see attn_bwd_dkdv.glsl).
#define MAXD 32
#include "attn_bwd_dkdv.glsl"
