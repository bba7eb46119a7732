// Adam and AdamW over up to 7 params in one dispatch (the math of adam.comp,
// per element). Param k gets first[k+1] - first[k] workgroups in a row and
// walks its own n[k] elements with them; every param has its own four
// bindings (param, grad, two moments), so the params need not share a buffer.
// Bindings past the dispatch's params are stand-ins no workgroup reaches.
#include "common.glsl"
// GRAD_T: the gradients' storage type, read with GLOAD / GLOAD4: T's, or bf16 beside f32 params
// (GRADS_BF16: mixed precision's bf16 gradients, widened here as they are read)
#ifdef GRADS_BF16
#extension GL_EXT_shader_16bit_storage : require
#define GRAD_T uint16_t
#define GRAD_T4 u16vec4
#define GLOAD(x) uintBitsToFloat(uint(x) << 16)
#define GLOAD4(x) uintBitsToFloat(uvec4(x) << 16)
#else
#define GRAD_T T
#define GRAD_T4 vec4
#define GLOAD(x) LOAD(x)
#define GLOAD4(x) (x)
#endif
layout(local_size_x = 256) in;
// lr beta1 beta2 eps grad_decay param_decay step_size inv_sqrt_bc2 one_minus_beta1 one_minus_beta2
layout(binding = 0) readonly buffer Hyper { float h[]; };
layout(binding = 1) readonly buffer Scale { float clip_scale; float skip; };  // skip: the loss scaler found an overflow
layout(binding = 2) buffer P0 { T p0[]; };
layout(binding = 3) readonly buffer G0 { GRAD_T g0[]; };
layout(binding = 4) buffer M0 { float m0[]; };
layout(binding = 5) buffer V0 { float v0[]; };
layout(binding = 6) buffer P1 { T p1[]; };
layout(binding = 7) readonly buffer G1 { GRAD_T g1[]; };
layout(binding = 8) buffer M1 { float m1[]; };
layout(binding = 9) buffer V1 { float v1[]; };
layout(binding = 10) buffer P2 { T p2[]; };
layout(binding = 11) readonly buffer G2 { GRAD_T g2[]; };
layout(binding = 12) buffer M2 { float m2[]; };
layout(binding = 13) buffer V2 { float v2[]; };
layout(binding = 14) buffer P3 { T p3[]; };
layout(binding = 15) readonly buffer G3 { GRAD_T g3[]; };
layout(binding = 16) buffer M3 { float m3[]; };
layout(binding = 17) buffer V3 { float v3[]; };
layout(binding = 18) buffer P4 { T p4[]; };
layout(binding = 19) readonly buffer G4 { GRAD_T g4[]; };
layout(binding = 20) buffer M4 { float m4[]; };
layout(binding = 21) buffer V4 { float v4[]; };
layout(binding = 22) buffer P5 { T p5[]; };
layout(binding = 23) readonly buffer G5 { GRAD_T g5[]; };
layout(binding = 24) buffer M5 { float m5[]; };
layout(binding = 25) buffer V5 { float v5[]; };
layout(binding = 26) buffer P6 { T p6[]; };
layout(binding = 27) readonly buffer G6 { GRAD_T g6[]; };
layout(binding = 28) buffer M6 { float m6[]; };
layout(binding = 29) buffer V6 { float v6[]; };
layout(push_constant) uniform Push { uint n[7]; uint first[8]; } pc;

// one element's (or one vector's) update: w and g read, the moments m and v read and written, the
// new param passed to SET
#define ADAM_STEP(TYPE, W, GRAD, M, V, SET)                                   \
    {                                                                         \
        TYPE w = W;                                                           \
        TYPE d = GRAD * clip_scale + grad_decay * w;                          \
        w *= param_decay;                                                     \
        TYPE mi = b1 * M + c1 * d;                                            \
        TYPE vi = b2 * V + c2 * d * d;                                        \
        M = mi;                                                               \
        V = vi;                                                               \
        SET(w - step_size * mi / (sqrt(vi) * inv_sqrt_bc2 + eps));            \
    }
#define ADAM_ONE(P, GR, M, V, from)                                           \
    for (uint i = from; i < count; i += stride)                               \
        ADAM_STEP(float, LOAD(P[i]), GLOAD(GR[i]), M[i], V[i], P[i] = STORE)

#ifdef FG_VECTORS
// adam_multi_vec (f32 params): 4 elements a step in 16-byte vectors (8-byte ones of bf16
// gradients), each param's tail past its last whole vector element by element
#define VIEWS(j, P, GR, M, V) \
    layout(binding = j) buffer P##V_ { vec4 P##v[]; }; \
    layout(binding = j + 1) readonly buffer GR##V_ { GRAD_T4 GR##v[]; }; \
    layout(binding = j + 2) buffer M##V_ { vec4 M##v[]; }; \
    layout(binding = j + 3) buffer V##V_ { vec4 V##v[]; };
VIEWS(2, p0, g0, m0, v0) VIEWS(6, p1, g1, m1, v1) VIEWS(10, p2, g2, m2, v2) VIEWS(14, p3, g3, m3, v3)
VIEWS(18, p4, g4, m4, v4) VIEWS(22, p5, g5, m5, v5) VIEWS(26, p6, g6, m6, v6)

#define ADAM(P, GR, M, V)                                                     \
    for (uint s = at; s < count / 4u; s += stride)                            \
        ADAM_STEP(vec4, P##v[s], GLOAD4(GR##v[s]), M##v[s], V##v[s], P##v[s] = ) \
    ADAM_ONE(P, GR, M, V, count / 4u * 4u + at)
#else
#define ADAM(P, GR, M, V) ADAM_ONE(P, GR, M, V, at)
#endif

void main() {
    if (skip != 0.0) return;
    uint wg = gl_WorkGroupID.x, slot = 0u;
    while (slot + 1u < 7u && wg >= pc.first[slot + 1u]) ++slot;
    if (wg >= pc.first[slot + 1u]) return;
    uint count = pc.n[slot];
    uint at = (wg - pc.first[slot]) * 256u + gl_LocalInvocationID.x;
    uint stride = (pc.first[slot + 1u] - pc.first[slot]) * 256u;
    float b1 = h[1], b2 = h[2], eps = h[3], grad_decay = h[4], param_decay = h[5];
    float step_size = h[6], inv_sqrt_bc2 = h[7];
    float c1 = h[8], c2 = h[9];   // 1 - beta, from the host in double: 1.0 - b2 here drops b2's low bits
    switch (slot) {
    case 0u: ADAM(p0, g0, m0, v0); break;
    case 1u: ADAM(p1, g1, m1, v1); break;
    case 2u: ADAM(p2, g2, m2, v2); break;
    case 3u: ADAM(p3, g3, m3, v3); break;
    case 4u: ADAM(p4, g4, m4, v4); break;
    case 5u: ADAM(p5, g5, m5, v5); break;
    case 6u: ADAM(p6, g6, m6, v6); break;
    }
}
