// variants: f32 f16 bf16
#version 450
// softmax / log_softmax along one axis, forward and backward. The tensor is
// seen as rows of L elements `inner` apart (axis -1: inner = 1); a segment of
// S lanes handles one row.
//   0 softmax:          y = exp(x - m) / s
//   1 log_softmax:      y = x - m - log(s)
//   2 softmax bwd:      a = y, dx = y * (g - sum(g * y))
//   3 log_softmax bwd:  a = y, dx = g - exp(y) * sum(g)
#include "common.glsl"

#define FG_WG 256
layout(local_size_x = FG_WG) in;

#include "segment_reduce.glsl"

layout(std430, set = 0, binding = 0) readonly buffer In { T a[]; };    // x (fwd) or y (bwd)
layout(std430, set = 0, binding = 1) readonly buffer Grad { T g[]; };  // bwd only
layout(std430, set = 0, binding = 2) writeonly buffer Out { T o[]; };  // y (fwd) or dx (bwd)

layout(push_constant) uniform Push {
    uint rows;
    uint L;
    uint inner;
    uint S;
    uint mode;
} pc;

void main() {
    uint S = pc.S;
    bool il = pc.inner > 1u;  // rows interleave in memory: so do the lanes
    uint lane = fg_seg_lane(S, il);
    uint per_group = FG_WG / S;
    uint mode = pc.mode;
    for (uint base = gl_WorkGroupID.x * per_group; base < pc.rows;
         base += gl_NumWorkGroups.x * per_group) {
        uint row = base + fg_seg_slot(S, il);
        bool live = row < pc.rows;
        uint start = live ? (row / pc.inner) * pc.L * pc.inner + row % pc.inner : 0u;
        uint step = pc.inner;
        if (mode < 2u) {
            float m = -uintBitsToFloat(0x7f800000u);
            if (live)
                for (uint j = lane; j < pc.L; j += S) m = fg_nanmax(m, LOAD(a[start + j * step]));
            m = fg_seg_max(m, S, il);
            float s = 0.0;
            if (live)
                for (uint j = lane; j < pc.L; j += S) s += exp(LOAD(a[start + j * step]) - m);
            s = fg_seg_sum(s, S, il);
            if (live) {
                float ls = log(s);
                for (uint j = lane; j < pc.L; j += S) {
                    uint i = start + j * step;
                    float z = LOAD(a[i]) - m;
                    o[i] = STORE(mode == 0u ? exp(z) / s : z - ls);
                }
            }
        } else {
            float d = 0.0;
            if (live)
                for (uint j = lane; j < pc.L; j += S) {
                    uint i = start + j * step;
                    d += mode == 2u ? LOAD(g[i]) * LOAD(a[i]) : LOAD(g[i]);
                }
            d = fg_seg_sum(d, S, il);
            if (live)
                for (uint j = lane; j < pc.L; j += S) {
                    uint i = start + j * step;
                    float y = LOAD(a[i]), gi = LOAD(g[i]);
                    o[i] = STORE(mode == 2u ? y * (gi - d) : gi - exp(y) * d);
                }
        }
    }
}
