// variants: f32 f16
#version 450
// dtable[v, d] = sum over positions n with ids[n] == v of g[n, d].
// One invocation per (table row, column) scanning the ids, so every output
// element has exactly one writer: race-free without float atomics, and the
// sum order is fixed (deterministic). The ids are staged through shared
// memory, one tile per workgroup pass.
#include "common.glsl"
#define TILE 64

layout(local_size_x = TILE) in;
layout(std430, set = 0, binding = 0) readonly buffer Ids { int ids[]; };
layout(std430, set = 0, binding = 1) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DTable { T dtable[]; };
layout(push_constant, std430) uniform Push { uint n, d, rows; } p;

shared int sid[TILE];

void main() {
    uint t = gl_LocalInvocationID.x;
    uint col = gl_WorkGroupID.x * TILE + t;
    for (uint row = gl_WorkGroupID.y; row < p.rows; row += gl_NumWorkGroups.y) {
        float acc = 0.0;
        for (uint n0 = 0u; n0 < p.n; n0 += TILE) {
            int id = -1;
            if (n0 + t < p.n) id = ids[n0 + t];
            sid[t] = id;
            barrier();
            uint cnt = min(uint(TILE), p.n - n0);
            if (col < p.d)
                for (uint j = 0u; j < cnt; ++j)
                    if (sid[j] == int(row)) acc += float(g[(n0 + j) * p.d + col]);
            barrier();
        }
        if (col < p.d) dtable[row * p.d + col] = T(acc);
    }
}
