#version 450
// Attention backward, dk/dv pass, head widths up to 256 (see attn_bwd_dkdv.glsl).
#define MAXD 256
#include "attn_bwd_dkdv.glsl"
