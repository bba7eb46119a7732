#version 450
// Attention backward, dk/dv pass, head widths up to 64 (see attn_bwd_dkdv.glsl).
#define MAXD 64
#include "attn_bwd_dkdv.glsl"
