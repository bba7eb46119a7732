// cast_f16.comp over up to 15 tensors in one dispatch: dir 0 f32 -> f16
// (round to nearest), dir 1 f16 -> f32 (the bf16 build: bf16 alike). Tensor j is the pair of bindings
// j (f32) and 15 + j (f16); it gets workgroups first[j] .. first[j+1] - 1
// and walks its own n[j] elements with them. The recorder merges a run of
// independent cast_f16 dispatches into this one (multi_tensor.py).
#ifndef BF16
#define F16 1   // the half side of the plain build
#endif
#include "common.glsl"

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) buffer A0 { float a0[]; };
layout(std430, set = 0, binding = 1) buffer A1 { float a1[]; };
layout(std430, set = 0, binding = 2) buffer A2 { float a2[]; };
layout(std430, set = 0, binding = 3) buffer A3 { float a3[]; };
layout(std430, set = 0, binding = 4) buffer A4 { float a4[]; };
layout(std430, set = 0, binding = 5) buffer A5 { float a5[]; };
layout(std430, set = 0, binding = 6) buffer A6 { float a6[]; };
layout(std430, set = 0, binding = 7) buffer A7 { float a7[]; };
layout(std430, set = 0, binding = 8) buffer A8 { float a8[]; };
layout(std430, set = 0, binding = 9) buffer A9 { float a9[]; };
layout(std430, set = 0, binding = 10) buffer A10 { float a10[]; };
layout(std430, set = 0, binding = 11) buffer A11 { float a11[]; };
layout(std430, set = 0, binding = 12) buffer A12 { float a12[]; };
layout(std430, set = 0, binding = 13) buffer A13 { float a13[]; };
layout(std430, set = 0, binding = 14) buffer A14 { float a14[]; };
layout(std430, set = 0, binding = 15) buffer H0 { T h0[]; };
layout(std430, set = 0, binding = 16) buffer H1 { T h1[]; };
layout(std430, set = 0, binding = 17) buffer H2 { T h2[]; };
layout(std430, set = 0, binding = 18) buffer H3 { T h3[]; };
layout(std430, set = 0, binding = 19) buffer H4 { T h4[]; };
layout(std430, set = 0, binding = 20) buffer H5 { T h5[]; };
layout(std430, set = 0, binding = 21) buffer H6 { T h6[]; };
layout(std430, set = 0, binding = 22) buffer H7 { T h7[]; };
layout(std430, set = 0, binding = 23) buffer H8 { T h8[]; };
layout(std430, set = 0, binding = 24) buffer H9 { T h9[]; };
layout(std430, set = 0, binding = 25) buffer H10 { T h10[]; };
layout(std430, set = 0, binding = 26) buffer H11 { T h11[]; };
layout(std430, set = 0, binding = 27) buffer H12 { T h12[]; };
layout(std430, set = 0, binding = 28) buffer H13 { T h13[]; };
layout(std430, set = 0, binding = 29) buffer H14 { T h14[]; };
layout(push_constant) uniform Push { uint dir; uint n[15]; uint first[16]; } pc;

#ifdef FG_VECTORS
// cast_f16_multi_vec: 8 elements a step, two 16-byte vectors of f32 against one of halves
// (vectors.glsl), each tensor's tail past its last whole step element by element
#include "vectors.glsl"
#define VIEWS(j) \
    layout(std430, set = 0, binding = j) buffer A##j##V { vec4 a##j##v[]; }; \
    layout(std430, set = 0, binding = 15 + j) buffer H##j##V { uvec4 h##j##v[]; };
VIEWS(0) VIEWS(1) VIEWS(2) VIEWS(3) VIEWS(4) VIEWS(5) VIEWS(6) VIEWS(7)
VIEWS(8) VIEWS(9) VIEWS(10) VIEWS(11) VIEWS(12) VIEWS(13) VIEWS(14)

#define CAST(A, H)                                                              \
    for (uint s = at; s < count / VW; s += stride) {                            \
        if (pc.dir == 0u) {                                                     \
            vec4 lo = A##v[2u * s], hi = A##v[2u * s + 1u];                     \
            H##v[s] = uvec4(vpair(lo.x, lo.y), vpair(lo.z, lo.w), vpair(hi.x, hi.y), vpair(hi.z, hi.w)); \
        } else {                                                                \
            uvec4 q = H##v[s];                                                  \
            A##v[2u * s] = vec4(vel(q, 0u), vel(q, 1u), vel(q, 2u), vel(q, 3u)); \
            A##v[2u * s + 1u] = vec4(vel(q, 4u), vel(q, 5u), vel(q, 6u), vel(q, 7u)); \
        }                                                                       \
    }                                                                           \
    for (uint k = count / VW * VW + at; k < count; k += stride) {              \
        if (pc.dir == 0u) H[k] = STORE(A[k]);                                   \
        else A[k] = LOAD(H[k]);                                                 \
    }
#else
#define CAST(A, H)                                              \
    for (uint k = at; k < count; k += stride) {                 \
        if (pc.dir == 0u) H[k] = STORE(A[k]);                   \
        else A[k] = LOAD(H[k]);                                 \
    }
#endif

void main() {
    uint wg = gl_WorkGroupID.x, slot = 0u;
    while (slot + 1u < 15u && wg >= pc.first[slot + 1u]) ++slot;
    if (wg >= pc.first[slot + 1u]) return;
    uint count = pc.n[slot];
    uint at = (wg - pc.first[slot]) * 256u + gl_LocalInvocationID.x;
    uint stride = (pc.first[slot + 1u] - pc.first[slot]) * 256u;
    switch (slot) {
    case 0u: CAST(a0, h0); break;
    case 1u: CAST(a1, h1); break;
    case 2u: CAST(a2, h2); break;
    case 3u: CAST(a3, h3); break;
    case 4u: CAST(a4, h4); break;
    case 5u: CAST(a5, h5); break;
    case 6u: CAST(a6, h6); break;
    case 7u: CAST(a7, h7); break;
    case 8u: CAST(a8, h8); break;
    case 9u: CAST(a9, h9); break;
    case 10u: CAST(a10, h10); break;
    case 11u: CAST(a11, h11); break;
    case 12u: CAST(a12, h12); break;
    case 13u: CAST(a13, h13); break;
    case 14u: CAST(a14, h14); break;
    }
}
