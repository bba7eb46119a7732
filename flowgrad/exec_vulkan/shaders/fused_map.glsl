// A chain of map ops in one pass: per element, read up to 4 inputs into
// registers r0..r3, run a short program of map ops (map_apply.glsl, the ops
// map_reduce.comp runs one at a time; M_PARAM loads a constant), instruction
// k writing register 4 + k, and store one or two registers to the outputs.
//
// The program comes as specialization constants: one precompiled kernel
// runs every fused chain (the machines flowgrad runs on have no shader
// compiler), and the driver compiles each chain's pipeline with its program
// folded in, so registers are registers, not an array indexed at run time,
// and no instruction decodes an op. Each input is read through its own
// strides over an index space of rank <= 3 (0 on a broadcast axis). In the
// f16 build every instruction's result is rounded to f16, as the same ops
// run one dispatch each would store it, so fusing never changes a value.
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

#define FG_WG 256
layout(local_size_x = FG_WG) in;

#include "fg_math.glsl"

layout(std430, set = 0, binding = 0) readonly buffer In0 { T x0[]; };
layout(std430, set = 0, binding = 1) readonly buffer In1 { T x1[]; };
layout(std430, set = 0, binding = 2) readonly buffer In2 { T x2[]; };
layout(std430, set = 0, binding = 3) readonly buffer In3 { T x3[]; };
layout(std430, set = 0, binding = 4) writeonly buffer Out0 { T y0[]; };
layout(std430, set = 0, binding = 5) writeonly buffer Out1 { T y1[]; };

layout(push_constant) uniform Push {
    uint n;         // elements of the index space
    uint shape[3];
    uint st[12];    // input k's stride along axis d: st[3 * k + d]
    float param[8];
} pc;

// rank | inputs << 2 | instructions << 5 | outputs << 11 | out0 reg << 13 | out1 reg << 19
layout(constant_id = 0) const uint META = 0u;
// instruction k: map op | a << 7 | b << 13 | c << 19 | param slot << 25 (registers 0..35)
layout(constant_id = 1) const uint P0 = 0u;
layout(constant_id = 2) const uint P1 = 0u;
layout(constant_id = 3) const uint P2 = 0u;
layout(constant_id = 4) const uint P3 = 0u;
layout(constant_id = 5) const uint P4 = 0u;
layout(constant_id = 6) const uint P5 = 0u;
layout(constant_id = 7) const uint P6 = 0u;
layout(constant_id = 8) const uint P7 = 0u;
layout(constant_id = 9) const uint P8 = 0u;
layout(constant_id = 10) const uint P9 = 0u;
layout(constant_id = 11) const uint P10 = 0u;
layout(constant_id = 12) const uint P11 = 0u;
layout(constant_id = 13) const uint P12 = 0u;
layout(constant_id = 14) const uint P13 = 0u;
layout(constant_id = 15) const uint P14 = 0u;
layout(constant_id = 16) const uint P15 = 0u;
layout(constant_id = 17) const uint P16 = 0u;
layout(constant_id = 18) const uint P17 = 0u;
layout(constant_id = 19) const uint P18 = 0u;
layout(constant_id = 20) const uint P19 = 0u;
layout(constant_id = 21) const uint P20 = 0u;
layout(constant_id = 22) const uint P21 = 0u;
layout(constant_id = 23) const uint P22 = 0u;
layout(constant_id = 24) const uint P23 = 0u;
layout(constant_id = 25) const uint P24 = 0u;
layout(constant_id = 26) const uint P25 = 0u;
layout(constant_id = 27) const uint P26 = 0u;
layout(constant_id = 28) const uint P27 = 0u;
layout(constant_id = 29) const uint P28 = 0u;
layout(constant_id = 30) const uint P29 = 0u;
layout(constant_id = 31) const uint P30 = 0u;
layout(constant_id = 32) const uint P31 = 0u;
#include "map_ops.glsl"
#include "map_apply.glsl"

#ifdef FG_VECTORS
// fused_map_vec: a chain whose inputs are all read at the element's own index (one
// axis, every stride 1) moves VW elements a load and a store (vectors.glsl), the
// tail past the last whole vector element by element
#include "vectors.glsl"
layout(std430, set = 0, binding = 0) readonly buffer In0V { VT x0v[]; };
layout(std430, set = 0, binding = 1) readonly buffer In1V { VT x1v[]; };
layout(std430, set = 0, binding = 2) readonly buffer In2V { VT x2v[]; };
layout(std430, set = 0, binding = 3) readonly buffer In3V { VT x3v[]; };
layout(std430, set = 0, binding = 4) writeonly buffer Out0V { VT y0v[]; };
layout(std430, set = 0, binding = 5) writeonly buffer Out1V { VT y1v[]; };

VT load_vector(uint k, uint v) {
    switch (k) {
    case 0u: return x0v[v];
    case 1u: return x1v[v];
    case 2u: return x2v[v];
    }
    return x3v[v];
}
#endif

float load_input(uint k, uint at) {
    switch (k) {
    case 0u: return LOAD(x0[at]);
    case 1u: return LOAD(x1[at]);
    case 2u: return LOAD(x2[at]);
    }
    return LOAD(x3[at]);
}

// the chain's program on registers r (inputs in r[0..3]), each result rounded as stored
#define RUN_PROGRAM(r)                                                                                 \
    [[unroll]] for (uint k = 0u; k < 32u; ++k) {                                                      \
        if (k < ninstr) {                                                                             \
            uint ins = prog[k];                                                                       \
            float v = map_apply(ins & 0x7fu, r[(ins >> 7) & 63u], r[(ins >> 13) & 63u], r[(ins >> 19) & 63u], \
                                pc.param[(ins >> 25) & 7u]);                                          \
            r[4u + k] = LOAD(STORE(v));                                                               \
        }                                                                                             \
    }

void main() {
    const uint rank = META & 3u;
    const uint nin = (META >> 2) & 7u;
    const uint ninstr = (META >> 5) & 63u;
    const uint nout = (META >> 11) & 3u;
    uint prog[32] = uint[32](P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15, P16, P17,
                             P18, P19, P20, P21, P22, P23, P24, P25, P26, P27, P28, P29, P30, P31);
#ifdef FG_VECTORS
    uint nv = pc.n / VW;
    for (uint v = gl_GlobalInvocationID.x; v < nv; v += gl_NumWorkGroups.x * FG_WG) {
        VT q[4];
        [[unroll]] for (uint k = 0u; k < 4u; ++k) q[k] = k < nin ? load_vector(k, v) : VT(0);
        float o0[VW], o1[VW];
        [[unroll]] for (uint e = 0u; e < VW; ++e) {
            float r[36];
            [[unroll]] for (uint k = 0u; k < 4u; ++k) r[k] = vel(q[k], e);
            RUN_PROGRAM(r)
            o0[e] = r[(META >> 13) & 63u];
            o1[e] = r[(META >> 19) & 63u];
        }
        y0v[v] = vpack(o0);
        if (nout > 1u) y1v[v] = vpack(o1);
    }
    for (uint i = nv * VW + gl_GlobalInvocationID.x; i < pc.n; i += gl_NumWorkGroups.x * FG_WG) {
#else
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += gl_NumWorkGroups.x * FG_WG) {
#endif
        uint c[3] = uint[3](0u, 0u, 0u);
        uint rest = i;
        [[unroll]] for (int d = 2; d >= 0; --d) {
            if (d < int(rank)) {
                c[d] = rest % pc.shape[d];
                rest /= pc.shape[d];
            }
        }
        float r[36];
        [[unroll]] for (uint k = 0u; k < 4u; ++k) {
            r[k] = 0.0;
            if (k < nin) {
                uint at = c[0] * pc.st[3u * k] + c[1] * pc.st[3u * k + 1u] + c[2] * pc.st[3u * k + 2u];
                r[k] = load_input(k, at);
            }
        }
        RUN_PROGRAM(r)
        y0[i] = STORE(r[(META >> 13) & 63u]);
        if (nout > 1u) y1[i] = STORE(r[(META >> 19) & 63u]);
    }
}
