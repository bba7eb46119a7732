// variants: f32 f16 bf16
#version 450
// topk along one axis (length L, element stride `inner`), one invocation
// per row: k selection passes, each the largest element after the previous
// pick in the order (value descending, index ascending), so ties go to the
// lower index, as numpy's stable sort.
//   mode 0: values -> vals [.., k];  mode 1: indices -> idx (i32);
//   mode 2: backward -> dx, zero but at the picks, where it is g;
//   mode 3: pick -> vals [.., k], g (shaped as x) at the picks.
#include "common.glsl"

layout(local_size_x = 64) in;
layout(std430, set = 0, binding = 0) readonly buffer BufX { T x[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufG { T g[]; };
layout(std430, set = 0, binding = 2) writeonly buffer BufV { T vals[]; };
layout(std430, set = 0, binding = 3) writeonly buffer BufI { int idx[]; };
layout(push_constant, std430) uniform Push {
    uint rows, L, inner, k, mode;
} p;

void main() {
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint row = gl_GlobalInvocationID.x; row < p.rows; row += step) {
        uint base = (row / p.inner) * p.L * p.inner + row % p.inner;
        uint obase = (row / p.inner) * p.k * p.inner + row % p.inner;
        if (p.mode == 2u)
            for (uint j = 0u; j < p.L; ++j) vals[base + j * p.inner] = STORE(0.0);
        float pv = 0.0;
        int pi = -1;
        for (uint r = 0u; r < p.k; ++r) {
            float bv = 0.0;
            int bi = -1;
            for (uint j = 0u; j < p.L; ++j) {
                float v = LOAD(x[base + j * p.inner]);
                bool after = pi < 0 || v < pv || (v == pv && int(j) > pi);
                if (after && (bi < 0 || v > bv)) { bv = v; bi = int(j); }
            }
            pv = bv;
            pi = bi;
            uint o = obase + r * p.inner;
            if (p.mode == 0u) vals[o] = STORE(bv);
            else if (p.mode == 1u) idx[o] = bi;
            else if (p.mode == 2u) vals[base + uint(bi) * p.inner] = g[o];
            else vals[o] = g[base + uint(bi) * p.inner];
        }
    }
}
