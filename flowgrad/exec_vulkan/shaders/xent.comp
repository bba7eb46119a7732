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
//                  raise, the host reads `bad` back and does, index_checks.py)
//   1 mean:        out[0] = sum(rl[2r]) / sum(rl[2r+1]), rl[2N] = the
//                  denominator, for a backward that reads rl (one workgroup)
//   3 denominator: rl[2N] = sum(rl[2r+1])                  (one workgroup)
//   2 backward:    dx[r, c] = g / rl[2N] * ((1-eps) tw_r (p_c - [c == t_r])
//                                            + eps/C valid_r (W p_c - w_c)),  W = sum w
// A segment of S lanes handles one row (modes 0 and 2). has_weight == 0: w is all ones.
// log_probs != 0 (nll_loss): x holds log-probabilities, so lse is 0 and p is not used.
// wide != 0 (the f16 build only): g, w and the loss are f32 beside f16 logits and dx
// (dtype="mixed" runs the loss in f32: its logits' casts to f32 and back are done here).
#include "common.glsl"

#define FG_WG 256
layout(local_size_x = FG_WG) in;

#include "segment_reduce.glsl"

layout(std430, set = 0, binding = 0) readonly buffer X { T x[]; };
layout(std430, set = 0, binding = 1) readonly buffer Tg { int tgt[]; };
layout(std430, set = 0, binding = 2) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 2) readonly buffer G32 { float g32[]; };
layout(std430, set = 0, binding = 3) writeonly buffer O { T o[]; };  // loss or dx
layout(std430, set = 0, binding = 3) writeonly buffer O32 { float o32[]; };  // a wide loss
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
} pc;

float weight(uint c) {
    if (pc.has_weight == 0u) return 1.0;
    return pc.wide != 0u ? w32[c] : LOAD(w[c]);
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
    float nan = uintBitsToFloat(0x7fc00000u);
    uint per_group = FG_WG / S;
    for (uint base = gl_WorkGroupID.x * per_group; base < pc.N;
         base += gl_NumWorkGroups.x * per_group) {
        uint row = base + fg_seg_slot(S, false);
        bool live = row < pc.N;
        uint start = row * pc.C;
        float m = -uintBitsToFloat(0x7f800000u);
        if (live)
            for (uint j = lane; j < pc.C; j += S) m = fg_nanmax(m, LOAD(x[start + j]));
        m = fg_seg_max(m, S, false);
        float s = 0.0, wsum = 0.0, wz = 0.0;
        if (live)
            for (uint j = lane; j < pc.C; j += S) {
                float z = LOAD(x[start + j]);
                s += exp(z - m);
                wsum += weight(j);
                wz += weight(j) * z;
            }
        s = fg_seg_sum(s, S, false);
        wsum = fg_seg_sum(wsum, S, false);
        wz = fg_seg_sum(wz, S, false);
        if (!live) continue;
        int t = tgt[row];
        bool ignored = t == pc.ignore_index;
        bool ok = ignored || (t >= 0 && uint(t) < pc.C);
        float lse = pc.log_probs != 0u ? 0.0 : m + log(s);
        float tw = ignored || !ok ? 0.0 : weight(uint(t));
        float valid = ignored ? 0.0 : 1.0;
        float sm = pc.eps / float(pc.C) * valid;
        if (pc.mode == 0u) {
            if (lane == 0u) {
                float nll = ignored || !ok ? 0.0 : lse - LOAD(x[start + uint(t)]);
                // -sum_c w_c logp_c = W lse - sum_c w_c z_c
                // no smoothing leaves its term out: a -inf logit makes it inf, and 0 * inf is NaN
                float smoothing = sm == 0.0 ? 0.0 : sm * (wsum * lse - wz);
                rl[2u * row] = ok ? (1.0 - pc.eps) * tw * nll + smoothing : nan;
                rl[2u * row + 1u] = tw;
                if (!ok) atomicMin(bad, row);
            }
        } else {
            float k = (pc.wide != 0u ? g32[0] : LOAD(g[0])) / rl[2u * pc.N];
            for (uint j = lane; j < pc.C; j += S) {
                float p = pc.log_probs != 0u ? 0.0 : exp(LOAD(x[start + j]) - lse);
                float d = (1.0 - pc.eps) * tw * (p - (int(j) == t ? 1.0 : 0.0)) + sm * (wsum * p - weight(j));
                o[start + j] = STORE(ok ? k * d : nan);
            }
        }
    }
}
