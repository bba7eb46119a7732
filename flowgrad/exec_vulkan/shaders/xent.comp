// variants: f32 f16
#version 450
// cross_entropy(logits [N, C], targets i32 [N]), mean over the N rows.
//   0 row losses:  rl[r] = m + log(s) - x[r, t_r]  (f32 scratch; NaN when
//                  t_r is outside [0, C): a GPU can't raise, so the bad value
//                  shows in the loss instead)
//   1 mean:        out[0] = sum(rl) * scale   (one workgroup, S = 256)
//   2 backward:    dx[r, c] = g * scale * (softmax(x_r)_c - (c == t_r))
// A segment of S lanes handles one row (modes 0 and 2).
#include "common.glsl"

#define FG_WG 256
layout(local_size_x = FG_WG) in;

#include "segment_reduce.glsl"

layout(std430, set = 0, binding = 0) readonly buffer X { T x[]; };
layout(std430, set = 0, binding = 1) readonly buffer Tg { int tgt[]; };
layout(std430, set = 0, binding = 2) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 3) writeonly buffer O { T o[]; };  // loss or dx
layout(std430, set = 0, binding = 4) buffer RL { float rl[]; };

layout(push_constant) uniform Push {
    uint N;
    uint C;
    uint S;
    uint mode;
    float scale;
} pc;

void main() {
    uint S = pc.S;
    uint lid = gl_LocalInvocationID.x;
    uint lane = fg_seg_lane(S, false);
    if (pc.mode == 1u) {
        float s = 0.0;
        for (uint r = lid; r < pc.N; r += FG_WG) s += rl[r];
        s = fg_seg_sum(s, FG_WG, false);
        if (lid == 0u) o[0] = T(s * pc.scale);
        return;
    }
    uint per_group = FG_WG / S;
    for (uint base = gl_WorkGroupID.x * per_group; base < pc.N;
         base += gl_NumWorkGroups.x * per_group) {
        uint row = base + fg_seg_slot(S, false);
        bool live = row < pc.N;
        uint start = row * pc.C;
        float m = -uintBitsToFloat(0x7f800000u);
        if (live)
            for (uint j = lane; j < pc.C; j += S) m = fg_nanmax(m, float(x[start + j]));
        m = fg_seg_max(m, S, false);
        float s = 0.0;
        if (live)
            for (uint j = lane; j < pc.C; j += S) s += exp(float(x[start + j]) - m);
        s = fg_seg_sum(s, S, false);
        if (live) {
            int t = tgt[row];
            bool ok = t >= 0 && uint(t) < pc.C;
            if (pc.mode == 0u) {
                if (lane == 0u)
                    rl[row] = ok ? m + log(s) - float(x[start + uint(t)]) : uintBitsToFloat(0x7fc00000u);
            } else {
                float k = float(g[0]) * pc.scale;
                for (uint j = lane; j < pc.C; j += S) {
                    float p = exp(float(x[start + j]) - m) / s;
                    float d = ok ? p - (int(j) == t ? 1.0 : 0.0) : uintBitsToFloat(0x7fc00000u);
                    o[start + j] = T(k * d);
                }
            }
        }
    }
}
