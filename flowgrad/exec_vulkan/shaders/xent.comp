// variants: f32 f16 bf16
#version 450
// cross_entropy(logits [N, C], targets i32 [N], class weights w [C]) with
// ignore_index and label smoothing eps, the weighted mean over the rows
// that count (PyTorch's reduction="mean"):
//   loss = sum_r (1-eps) tw_r nll_r + eps/C valid_r sum_c w_c (-logp_rc)  /  sum_r tw_r
// where tw_r = w[t_r] (0 for an ignored row).
//   0 rows:        rl[2r] = that row's numerator, rl[2r+1] = tw_r (f32
//                  scratch; NaN when t_r is neither ignored nor in [0, C),
//                  and the smallest such r lands in `bad`: a GPU can't
//                  raise, the host reads `bad` back and does, index_checks.py);
//                  rl[2N+1+2r] = lse_r, rl[2N+2+2r] = W = sum_c w_c, for the backward
//   1 mean:        out[0] = sum(rl[2r]) / sum(rl[2r+1]), rl[2N] = the
//                  denominator, for a backward that reads rl (one workgroup)
//   3 denominator: rl[2N] = sum(rl[2r+1])                  (one workgroup)
//   2 backward:    dx[r, c] = g / rl[2N] * ((1-eps) tw_r (p_c - [c == t_r])
//                                            + eps/C valid_r (W p_c - w_c)),  p_c = exp(x_rc - lse_r)
// A segment of S lanes handles one row (modes 0 and 2): mode 0 reads it once,
// keeping a running max and the sum of exp(x - max) rescaled as the max grows;
// mode 2 reads it once more and writes dx, from the lse mode 0 left.
// has_weight == 0: w is all ones.
// log_probs != 0 (nll_loss): x holds log-probabilities, so lse is 0 and p is not used.
// wide != 0 (the f16 build only): g, w and the loss are f32 beside f16 logits and dx
// (dtype="mixed" runs the loss in f32: its logits' casts to f32 and back are done here).
// vec != 0: C is a multiple of VW and x and dx start 16-byte aligned: each lane
// moves VW elements a 16-byte load or store.
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

#define FG_WG 256
layout(local_size_x = FG_WG) in;

#include "segment_reduce.glsl"

layout(std430, set = 0, binding = 0) readonly buffer X { T x[]; };
layout(std430, set = 0, binding = 0) readonly buffer XV { uvec4 xv[]; };
layout(std430, set = 0, binding = 1) readonly buffer Tg { int tgt[]; };
layout(std430, set = 0, binding = 2) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 2) readonly buffer G32 { float g32[]; };
layout(std430, set = 0, binding = 3) writeonly buffer O { T o[]; };  // loss or dx
layout(std430, set = 0, binding = 3) writeonly buffer O32 { float o32[]; };  // a wide loss
layout(std430, set = 0, binding = 3) writeonly buffer OV { uvec4 ov[]; };
layout(std430, set = 0, binding = 4) buffer RL { float rl[]; };
layout(std430, set = 0, binding = 5) readonly buffer Wt { T w[]; };
layout(std430, set = 0, binding = 5) readonly buffer Wt32 { float w32[]; };
layout(std430, set = 0, binding = 6) buffer Bad { uint bad; };

layout(push_constant) uniform Push {
    uint N;
    uint C;
    uint S;
    uint mode;
    int ignore_index;
    float eps;
    uint has_weight;
    uint log_probs;  // nll_loss: x already holds log-probabilities
    uint wide;       // g, w and the loss in f32
    uint vec;        // 16-byte loads and stores
} pc;

// elements per 16-byte vector; unpacked and packed as LOAD and STORE convert
#if defined(BF16)
#define VW 8u
void unpack(uvec4 q, out float z[VW]) {
    [[unroll]] for (uint k = 0u; k < 4u; ++k) {
        z[2u * k] = uintBitsToFloat(q[k] << 16);
        z[2u * k + 1u] = uintBitsToFloat(q[k] & 0xFFFF0000u);
    }
}
uvec4 pack(float z[VW]) {
    uvec4 q;
    [[unroll]] for (uint k = 0u; k < 4u; ++k) q[k] = fg_bf16(z[2u * k]) | (fg_bf16(z[2u * k + 1u]) << 16);
    return q;
}
#elif defined(F16)
#define VW 8u
void unpack(uvec4 q, out float z[VW]) {
    [[unroll]] for (uint k = 0u; k < 4u; ++k) {
        vec2 h = vec2(unpackFloat2x16(q[k]));
        z[2u * k] = h.x;
        z[2u * k + 1u] = h.y;
    }
}
uvec4 pack(float z[VW]) {
    uvec4 q;
    [[unroll]] for (uint k = 0u; k < 4u; ++k) q[k] = packFloat2x16(f16vec2(z[2u * k], z[2u * k + 1u]));
    return q;
}
#else
#define VW 4u
void unpack(uvec4 q, out float z[VW]) {
    [[unroll]] for (uint k = 0u; k < 4u; ++k) z[k] = uintBitsToFloat(q[k]);
}
uvec4 pack(float z[VW]) { return floatBitsToUint(vec4(z[0], z[1], z[2], z[3])); }
#endif

#define NEG_INF (-uintBitsToFloat(0x7f800000u))

float weight(uint c) {
    if (pc.has_weight == 0u) return 1.0;
    return pc.wide != 0u ? w32[c] : LOAD(w[c]);
}

// A row's running statistics: m the max so far (NaN once a NaN is seen), s = sum exp(z - m),
// W = sum w, wz = sum w z (those two only with smoothing).
struct Acc { float m, s, W, wz; };

// s's terms taken to a max M >= m; none while m is -inf (no term yet: s is 0)
float rescaled(float s, float m, float M) { return m == NEG_INF ? 0.0 : s * exp(m - M); }

// the W and wz terms of column c's logit z
void weigh(inout Acc a, float z, uint c) {
    float wc = weight(c);
    a.W += wc;
    a.wz += wc * z;
}

// logits z of columns c0 .. c0 + VW - 1: their max first, then each term once
void absorb(inout Acc a, float z[VW], uint c0) {
    if (pc.eps != 0.0)
        [[unroll]] for (uint k = 0u; k < VW; ++k) weigh(a, z[k], c0 + k);
    float M = a.m;
    [[unroll]] for (uint k = 0u; k < VW; ++k) M = fg_nanmax(M, z[k]);
    if (M == NEG_INF) return;   // nothing above -inf yet: no term
    float s = rescaled(a.s, a.m, M);
    [[unroll]] for (uint k = 0u; k < VW; ++k) s += exp(z[k] - M);
    a.m = M;
    a.s = s;
}

// one logit z of column c
void absorb1(inout Acc a, float z, uint c) {
    if (pc.eps != 0.0) weigh(a, z, c);
    float M = fg_nanmax(a.m, z);
    if (M == NEG_INF) return;
    a.s = rescaled(a.s, a.m, M) + exp(z - M);
    a.m = M;
}

Acc combine(Acc a, Acc b) {
    float M = fg_nanmax(a.m, b.m);
    return Acc(M, rescaled(a.s, a.m, M) + rescaled(b.s, b.m, M), a.W + b.W, a.wz + b.wz);
}

shared vec4 acc_seg[FG_WG];

// every lane of a segment of S consecutive lanes gets the segment's Acc (uniform control flow)
Acc seg_combine(Acc a, uint S) {
    if (S == 1u) return a;
    uint lid = gl_LocalInvocationID.x, lane = lid & (S - 1u);
    acc_seg[lid] = vec4(a.m, a.s, a.W, a.wz);
    barrier();
    for (uint h = S >> 1; h > 0u; h >>= 1) {
        if (lane < h) {
            vec4 p = acc_seg[lid], q = acc_seg[lid + h];
            Acc c = combine(Acc(p.x, p.y, p.z, p.w), Acc(q.x, q.y, q.z, q.w));
            acc_seg[lid] = vec4(c.m, c.s, c.W, c.wz);
        }
        barrier();
    }
    vec4 r = acc_seg[lid - lane];
    barrier();
    return Acc(r.x, r.y, r.z, r.w);
}

// one row's statistics over its lanes (live: the row exists)
Acc row_stats(uint row, bool live, uint lane, uint S) {
    Acc a = Acc(NEG_INF, 0.0, 0.0, 0.0);
    if (live) {
        uint start = row * pc.C;
        if (pc.vec != 0u) {
            uint base = start / VW;
            float z[VW];
            for (uint v = lane; v < pc.C / VW; v += S) {
                unpack(xv[base + v], z);
                absorb(a, z, v * VW);
            }
        } else {
            for (uint j = lane; j < pc.C; j += S) absorb1(a, LOAD(x[start + j]), j);
        }
    }
    return seg_combine(a, S);
}

void row_loss(uint row, Acc a) {
    float nan = uintBitsToFloat(0x7fc00000u);
    int t = tgt[row];
    bool ignored = t == pc.ignore_index;
    bool ok = ignored || (t >= 0 && uint(t) < pc.C);
    float lse = pc.log_probs != 0u ? 0.0 : a.m + log(a.s);
    float tw = ignored || !ok ? 0.0 : weight(uint(t));
    float sm = ignored ? 0.0 : pc.eps / float(pc.C);
    float nll = ignored || !ok ? 0.0 : lse - LOAD(x[row * pc.C + uint(t)]);
    // -sum_c w_c logp_c = W lse - sum_c w_c z_c
    // no smoothing leaves its term out: a -inf logit makes it inf, and 0 * inf is NaN
    float smoothing = sm == 0.0 ? 0.0 : sm * (a.W * lse - a.wz);
    rl[2u * row] = ok ? (1.0 - pc.eps) * tw * nll + smoothing : nan;
    rl[2u * row + 1u] = tw;
    rl[2u * pc.N + 1u + 2u * row] = lse;
    rl[2u * pc.N + 2u + 2u * row] = a.W;
    if (!ok) atomicMin(bad, row);
}

// dx of one element: k the gradient's scale, tw and sm the row's target weight and smoothing
float dx_of(float z, uint c, int t, float lse, float k, float tw, float sm, float W, bool ok) {
    float nan = uintBitsToFloat(0x7fc00000u);
    float p = pc.log_probs != 0u ? 0.0 : exp(z - lse);
    float d = (1.0 - pc.eps) * tw * (p - (int(c) == t ? 1.0 : 0.0)) + sm * (W * p - weight(c));
    return ok ? k * d : nan;
}

void row_grad(uint row, uint lane, uint S) {
    int t = tgt[row];
    bool ignored = t == pc.ignore_index;
    bool ok = ignored || (t >= 0 && uint(t) < pc.C);
    float lse = rl[2u * pc.N + 1u + 2u * row], W = rl[2u * pc.N + 2u + 2u * row];
    float tw = ignored || !ok ? 0.0 : weight(uint(t));
    float sm = ignored ? 0.0 : pc.eps / float(pc.C);
    float k = (pc.wide != 0u ? g32[0] : LOAD(g[0])) / rl[2u * pc.N];
    uint start = row * pc.C;
    if (pc.vec != 0u) {
        uint base = start / VW;
        float z[VW];
        for (uint v = lane; v < pc.C / VW; v += S) {
            unpack(xv[base + v], z);
            [[unroll]] for (uint e = 0u; e < VW; ++e) z[e] = dx_of(z[e], v * VW + e, t, lse, k, tw, sm, W, ok);
            ov[base + v] = pack(z);
        }
    } else {
        for (uint j = lane; j < pc.C; j += S) o[start + j] = STORE(dx_of(LOAD(x[start + j]), j, t, lse, k, tw, sm, W, ok));
    }
}

void main() {
    uint S = pc.S;
    uint lid = gl_LocalInvocationID.x;
    uint lane = fg_seg_lane(S, false);
    if (pc.mode == 1u || pc.mode == 3u) {
        float num = 0.0, den = 0.0;
        for (uint r = lid; r < pc.N; r += FG_WG) {
            num += rl[2u * r];
            den += rl[2u * r + 1u];
        }
        num = fg_seg_sum(num, FG_WG, false);
        den = fg_seg_sum(den, FG_WG, false);
        if (lid == 0u) {
            if (pc.mode == 1u && pc.wide != 0u) o32[0] = num / den;
            else if (pc.mode == 1u) o[0] = STORE(num / den);
            rl[2u * pc.N] = den;
        }
        return;
    }
    uint per_group = FG_WG / S;
    for (uint base = gl_WorkGroupID.x * per_group; base < pc.N;
         base += gl_NumWorkGroups.x * per_group) {
        uint row = base + fg_seg_slot(S, false);
        bool live = row < pc.N;
        if (pc.mode == 0u) {
            Acc a = row_stats(row, live, lane, S);   // barriers: every lane
            if (live && lane == 0u) row_loss(row, a);
        } else if (live) {
            row_grad(row, lane, S);
        }
    }
}
