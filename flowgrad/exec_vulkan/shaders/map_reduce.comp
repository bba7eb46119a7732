// variants: f32 f16
#version 450
// One kernel for every elementwise op and every axis reduction:
//   y[o] = scale * REDUCE_{r < R} MAP(x0[i0], x1[i1], x2[i2])
// over a logical index space of rank <= 6. Each input is addressed by its own
// strides in that space (0 on a broadcast axis), so numpy broadcasting,
// keepdims gradients and "sum the gradient over the broadcast axes" are all
// the same loop. Axes in `redmask` are reduced (R = their size product); the
// others (n_out = their size product) index the contiguous output, in order.
// A workgroup is cut into segments of S lanes (S = 1: one output per thread,
// plain elementwise; S = 256: one output per workgroup, a long reduction;
// see segment_reduce.glsl for the lane layout bit).
#include "common.glsl"

#define FG_WG 256
layout(local_size_x = FG_WG) in;

#include "fg_math.glsl"
#include "segment_reduce.glsl"

layout(std430, set = 0, binding = 0) readonly buffer In0 { T x0[]; };
layout(std430, set = 0, binding = 1) readonly buffer In1 { T x1[]; };
layout(std430, set = 0, binding = 2) readonly buffer In2 { T x2[]; };
layout(std430, set = 0, binding = 3) writeonly buffer Out { T y[]; };

layout(push_constant) uniform Push {
    uint n_out;     // outputs written: kept elements x chunks
    uint R;         // reduced elements per kept element (1: no reduction)
    uint S;         // lanes per output (power of two)
    uint code;      // map op | reduce op << 8 | interleaved lanes << 12 | rank << 13 | redmask << 16
    uint chunks;    // the reduced range is cut in this many pieces, each summed
                    // to its own output, chunk-major (y[c * n_kept + o]); a
                    // second dispatch then reduces the pieces
    float scale;    // applied to each output
    float param;    // the map op's scalar (pow's exponent)
    uint shape[6];
    uint st0[6];
    uint st1[6];
    uint st2[6];
} pc;

#include "map_ops.glsl"

float map_value(uint op, uint i0, uint i1, uint i2) {
    float a = float(x0[i0]);
    switch (op) {
    case M_COPY: return a;
    case M_ADD: return a + float(x1[i1]);
    case M_SUB: return a - float(x1[i1]);
    case M_MUL: return a * float(x1[i1]);
    case M_DIV: return a / float(x1[i1]);
    case M_NEG: return -a;
    case M_EXP: return exp(a);
    case M_LOG: return log(a);
    case M_SQRT: return sqrt(a);
    case M_TANH: return fg_tanh(a);
    case M_SIGMOID: return fg_sigmoid(a);
    case M_RELU: return (a > 0.0 || isnan(a)) ? a : 0.0;
    case M_GELU: return fg_gelu(a);
    case M_GELU_TANH: return fg_gelu_tanh(a);
    case M_SILU: return a * fg_sigmoid(a);
    case M_POW: return fg_pow(a, pc.param);
    case M_SQDIFF: { float d = a - float(x1[i1]); return d * d; }
    case M_EQ: return a == float(x1[i1]) ? 1.0 : 0.0;
    case M_DIV_DB: { float b = float(x2[i2]); return -a * (float(x1[i1]) / b) / b; }
    case M_EXP_B: return a * float(x2[i2]);
    case M_LOG_B: return a / float(x1[i1]);
    case M_SQRT_B: return a * 0.5 / float(x2[i2]);
    case M_TANH_B: { float t = float(x2[i2]); return a * (1.0 - t * t); }
    case M_SIGMOID_B: { float s = float(x2[i2]); return a * s * (1.0 - s); }
    case M_RELU_B: return float(x1[i1]) > 0.0 ? a : 0.0;
    case M_GELU_B: return a * fg_gelu_grad(float(x1[i1]));
    case M_GELU_TANH_B: return a * fg_gelu_tanh_grad(float(x1[i1]));
    case M_SILU_B: {
        float x = float(x1[i1]);
        float s = fg_sigmoid(x);
        return a * s * (1.0 + x * (1.0 - s));
    }
    case M_POW_B: return pc.param == 0.0 ? 0.0 : a * pc.param * fg_pow(float(x1[i1]), pc.param - 1.0);  // d/dx x^0 = 0, at 0 too
    case M_MAX_B: return float(x1[i1]) == float(x2[i2]) ? a : 0.0;
    case M_DIFF_MUL: return float(x2[i2]) * (a - float(x1[i1]));
    case M_ABS: return abs(a);
    case M_ABS_B: return a * sign(float(x1[i1]));
    case M_MAXIMUM: return fg_nanmax(a, float(x1[i1]));
    case M_MINIMUM: return fg_nanmin(a, float(x1[i1]));
    case M_MAXIMUM_DA: { float s = float(x1[i1]), o = float(x2[i2]); return s > o ? a : (s == o ? 0.5 * a : 0.0); }
    case M_MINIMUM_DA: { float s = float(x1[i1]), o = float(x2[i2]); return s < o ? a : (s == o ? 0.5 * a : 0.0); }
    case M_WHERE: return a != 0.0 ? float(x1[i1]) : float(x2[i2]);
    case M_WHERE_DA: return float(x1[i1]) != 0.0 ? a : 0.0;
    case M_WHERE_DB: return float(x1[i1]) != 0.0 ? 0.0 : a;
    case M_CLAMP_MIN: return fg_nanmax(a, pc.param);
    case M_CLAMP_MIN_B: return float(x1[i1]) >= pc.param ? a : 0.0;
    case M_CLAMP_MAX: return fg_nanmin(a, pc.param);
    case M_CLAMP_MAX_B: return float(x1[i1]) <= pc.param ? a : 0.0;
    }
    return fg_nan();
}

void main() {
    uint S = pc.S;
    bool il = ((pc.code >> 12) & 1u) != 0u;
    int rank = int((pc.code >> 13) & 7u);
    uint redmask = (pc.code >> 16) & 0x3fu;
    uint n_kept = pc.n_out / pc.chunks;
    uint piece = (pc.R + pc.chunks - 1u) / pc.chunks;
    uint lane = fg_seg_lane(S, il);
    uint per_group = FG_WG / S;
    uint mop = pc.code & 0xffu;
    uint rop = (pc.code >> 8) & 0xfu;  // 0 sum, 1 max
    float identity = rop == 1u ? -fg_inf() : 0.0;
    // grid-stride over outputs; the trip count is uniform in a workgroup,
    // as the barriers in fg_seg_reduce2 require
    for (uint base = gl_WorkGroupID.x * per_group; base < pc.n_out;
         base += gl_NumWorkGroups.x * per_group) {
        uint slot_out = base + fg_seg_slot(S, il);
        float acc = identity;
        if (slot_out < pc.n_out) {
            uint chunk = slot_out / n_kept;
            uint o = slot_out - chunk * n_kept;
            uint r_end = min(pc.R, (chunk + 1u) * piece);
            uint k0 = 0u, k1 = 0u, k2 = 0u, rest = o;
            for (int d = rank - 1; d >= 0; --d) {
                if (((redmask >> d) & 1u) == 0u) {
                    uint c = rest % pc.shape[d];
                    rest /= pc.shape[d];
                    k0 += c * pc.st0[d];
                    k1 += c * pc.st1[d];
                    k2 += c * pc.st2[d];
                }
            }
            for (uint r = chunk * piece + lane; r < r_end; r += S) {
                uint i0 = k0, i1 = k1, i2 = k2, rr = r;
                for (int d = rank - 1; d >= 0; --d) {
                    if (((redmask >> d) & 1u) != 0u) {
                        uint c = rr % pc.shape[d];
                        rr /= pc.shape[d];
                        i0 += c * pc.st0[d];
                        i1 += c * pc.st1[d];
                        i2 += c * pc.st2[d];
                    }
                }
                float v = map_value(mop, i0, i1, i2);
                acc = rop == 1u ? fg_nanmax(acc, v) : acc + v;
            }
        }
        acc = fg_seg_reduce2(vec2(acc, 0.0), S, rop, il).x;
        if (lane == 0u && slot_out < pc.n_out) y[slot_out] = T(acc * pc.scale);
    }
}
