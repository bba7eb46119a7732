// variants: f32 f16 bf16
// Loss scaling, part 1, over up to 12 gradients in one dispatch: each
// gradient times 1/scale, in place, and flags[k] = 1 if any of them holds an
// inf or a NaN (the flags are zeroed before; several workgroups may write
// the same 1). Gradient j gets workgroups first[j] .. first[j+1] - 1 and
// walks its own n[j] elements with them (unscale.comp's math, per element).
#version 450
#include "common.glsl"
layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer Scale { float scale; float inv_scale; };
layout(binding = 1) buffer Flags { float flags[]; };
layout(binding = 2) buffer G0 { T g0[]; };
layout(binding = 3) buffer G1 { T g1[]; };
layout(binding = 4) buffer G2 { T g2[]; };
layout(binding = 5) buffer G3 { T g3[]; };
layout(binding = 6) buffer G4 { T g4[]; };
layout(binding = 7) buffer G5 { T g5[]; };
layout(binding = 8) buffer G6 { T g6[]; };
layout(binding = 9) buffer G7 { T g7[]; };
layout(binding = 10) buffer G8 { T g8[]; };
layout(binding = 11) buffer G9 { T g9[]; };
layout(binding = 12) buffer G10 { T g10[]; };
layout(binding = 13) buffer G11 { T g11[]; };
layout(push_constant) uniform Push { uint k; uint n[12]; uint first[13]; } pc;

#define UNSCALE(G)                                   \
    for (uint i = at; i < count; i += stride) {      \
        float x = LOAD(G[i]);                        \
        bad = bad || isnan(x) || isinf(x);           \
        G[i] = STORE(x * inv_scale);                 \
    }

void main() {
    uint wg = gl_WorkGroupID.x, slot = 0u;
    while (slot + 1u < 12u && wg >= pc.first[slot + 1u]) ++slot;
    if (wg >= pc.first[slot + 1u]) return;
    uint count = pc.n[slot];
    uint at = (wg - pc.first[slot]) * 256u + gl_LocalInvocationID.x;
    uint stride = (pc.first[slot + 1u] - pc.first[slot]) * 256u;
    bool bad = false;
    switch (slot) {
    case 0u: UNSCALE(g0); break;
    case 1u: UNSCALE(g1); break;
    case 2u: UNSCALE(g2); break;
    case 3u: UNSCALE(g3); break;
    case 4u: UNSCALE(g4); break;
    case 5u: UNSCALE(g5); break;
    case 6u: UNSCALE(g6); break;
    case 7u: UNSCALE(g7); break;
    case 8u: UNSCALE(g8); break;
    case 9u: UNSCALE(g9); break;
    case 10u: UNSCALE(g10); break;
    case 11u: UNSCALE(g11); break;
    }
    if (bad) flags[pc.k] = 1.0;
}
