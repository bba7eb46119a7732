// variants: f32 f16
#version 450
// dtable[v, d] = sum over positions n with ids[n] == v of g[n, d].
// Each invocation owns one column of a block of RB table rows and scans the
// ids, so every output element has exactly one writer: race-free without
// float atomics, and the sum order is fixed (deterministic). The ids are
// staged through shared memory a tile at a time; a block of rows shares each
// scan, so the scans cost rows/RB passes over the ids, not rows. Workgroup z
// takes the z-th chunk of the ids and writes its partial sums to slice z of
// dtable (the caller sums the slices), so a small table still fills the GPU.
#include "common.glsl"
#define TILE 64
#define RB 8

layout(local_size_x = TILE) in;
layout(std430, set = 0, binding = 0) readonly buffer Ids { int ids[]; };
layout(std430, set = 0, binding = 1) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 2) writeonly buffer DTable { T dtable[]; };
layout(push_constant, std430) uniform Push { uint n, d, rows, chunk; } p;

shared int sid[TILE];

void main() {
    uint t = gl_LocalInvocationID.x;
    uint col = gl_WorkGroupID.x * TILE + t;
    uint first = gl_WorkGroupID.z * p.chunk, last = min(p.n, first + p.chunk);
    uint slice = gl_WorkGroupID.z * p.rows * p.d;
    for (uint row0 = gl_WorkGroupID.y * RB; row0 < p.rows; row0 += gl_NumWorkGroups.y * RB) {
        float acc[RB];
        for (int r = 0; r < RB; ++r) acc[r] = 0.0;
        for (uint n0 = first; n0 < last; n0 += TILE) {
            int id = -1;
            if (n0 + t < last) id = ids[n0 + t];
            sid[t] = id - int(row0);  // the id's row within this block
            barrier();
            uint cnt = min(uint(TILE), last - n0);
            if (col < p.d) {
                for (uint j = 0u; j < cnt; ++j) {
                    int r = sid[j];
                    if (r >= 0 && r < RB) {
                        float gv = LOAD(g[(n0 + j) * p.d + col]);
                        for (int k = 0; k < RB; ++k)  // constant indices keep acc in registers
                            if (k == r) acc[k] += gv;
                    }
                }
            }
            barrier();
        }
        if (col < p.d)
            for (uint k = 0u; k < RB; ++k)
                if (row0 + k < p.rows) dtable[slice + (row0 + k) * p.d + col] = STORE(acc[k]);
    }
}
