// variants: f32 f16 bf16
#version 450
// y[n] = scale * sum over r of x[r, n], x a contiguous [R, N] tensor (a bias
// gradient's column sums): map_reduce's sum over a leading axis, moved in
// 16-byte vectors. map_reduce gives a column to a segment of lanes, so a warp
// load brings one 2-byte element a lane; here a lane owns VW neighbouring
// columns and reads them as one vector. A workgroup takes a strip of CX
// vectors' columns and one chunk of the rows, its RL row lanes walking the
// chunk; their sums meet in shared memory, in row-lane order. With several
// chunks, each stores its strip's sums (f32) to its slot of `pieces`, and the
// last chunk of a strip to finish (a per-strip counter, 0 at the start) adds
// the strip's pieces in chunk order: the result does not depend on which
// workgroup finishes first, and a 16-bit sum is rounded once.
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "vectors.glsl"

#define CX 32u      // column vectors a workgroup takes
#define RL 8u       // its row lanes
#define LOADS 4u    // row vectors a lane has in flight
layout(local_size_x = CX, local_size_y = RL) in;

layout(std430, set = 0, binding = 0) readonly buffer X { VT x[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Y { T y[]; };
layout(std430, set = 0, binding = 2) coherent buffer Counts { uint counts[]; };   // one per strip
layout(std430, set = 0, binding = 3) coherent buffer Pieces { float pieces[]; };  // [chunks, N]

layout(push_constant) uniform Push {
    uint R;         // rows
    uint nv;        // column vectors: N / VW
    uint chunks;    // row chunks (the grid's y)
    uint rows;      // rows a chunk takes (the last may take fewer)
    float scale;
} pc;

shared float sums[RL][CX * VW];
shared uint last;   // 1: this workgroup is its strip's last chunk to finish

void add(inout float acc[VW], VT v) {
    [[unroll]] for (uint e = 0u; e < VW; ++e) acc[e] += vel(v, e);
}

void main() {
    uint lx = gl_LocalInvocationID.x, ly = gl_LocalInvocationID.y;
    uint cv = gl_WorkGroupID.x * CX + lx, chunk = gl_WorkGroupID.y;
    uint n = pc.nv * VW;
    float acc[VW];
    [[unroll]] for (uint e = 0u; e < VW; ++e) acc[e] = 0.0;
    if (cv < pc.nv) {
        uint r = chunk * pc.rows + ly, end = min(pc.R, (chunk + 1u) * pc.rows);
        // LOADS vectors go out together (a column sum waits on memory), added in row order
        for (; r + (LOADS - 1u) * RL < end; r += LOADS * RL) {
            VT v[LOADS];
            [[unroll]] for (uint u = 0u; u < LOADS; ++u) v[u] = x[(r + u * RL) * pc.nv + cv];
            [[unroll]] for (uint u = 0u; u < LOADS; ++u) add(acc, v[u]);
        }
        for (; r < end; r += RL) add(acc, x[r * pc.nv + cv]);
    }
    [[unroll]] for (uint e = 0u; e < VW; ++e) sums[ly][lx * VW + e] = acc[e];
    barrier();

    // the strip's CX * VW columns, a thread each
    uint strip0 = gl_WorkGroupID.x * CX * VW;
    for (uint c = gl_LocalInvocationIndex; c < CX * VW; c += CX * RL) {
        float s = 0.0;
        [[unroll]] for (uint l = 0u; l < RL; ++l) s += sums[l][c];
        sums[0][c] = s;
    }
    barrier();
    if (pc.chunks == 1u) {
        for (uint c = gl_LocalInvocationIndex; c < CX * VW && strip0 + c < n; c += CX * RL)
            y[strip0 + c] = STORE(sums[0][c] * pc.scale);
        return;
    }
    for (uint c = gl_LocalInvocationIndex; c < CX * VW && strip0 + c < n; c += CX * RL)
        pieces[chunk * n + strip0 + c] = sums[0][c];
    memoryBarrierBuffer();
    barrier();
    if (gl_LocalInvocationIndex == 0u) last = atomicAdd(counts[gl_WorkGroupID.x], 1u) == pc.chunks - 1u ? 1u : 0u;
    barrier();
    if (last == 0u) return;
    memoryBarrierBuffer();
    for (uint c = gl_LocalInvocationIndex; c < CX * VW && strip0 + c < n; c += CX * RL) {
        float total = 0.0;
        for (uint k = 0u; k < pc.chunks; ++k) total += pieces[k * n + strip0 + c];
        y[strip0 + c] = STORE(total * pc.scale);
    }
}
