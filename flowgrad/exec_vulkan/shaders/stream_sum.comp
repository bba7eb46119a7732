// variants: f32 f16 bf16
#version 450
// The sum of a stream-K GEMM's pieces (the _sk builds, gemm_stream.glsl): each output tile's
// partial products lie in f32 in slabs 0, 1, ... of `parts` (slabs of nz * M * N), one per
// workgroup that took some of the tile's K steps, in the order they took them; they are added
// in that order and the sum rounded once into C (C(z, m, n) at z * zc + m * scm + n, both
// multiples of 4). The tiles' numbering and the workgroups' shares of the steps are
// gemm_stream.glsl's: `groups` workgroups, `steps` steps a tile of bm x bn. Four columns an
// invocation (N is a multiple of 16).
#include "common.glsl"

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) readonly buffer Parts { vec4 parts[]; };
layout(std430, set = 0, binding = 1) writeonly buffer C { T4 c[]; };

layout(push_constant) uniform Push {
    uint M, N, nz, bm, bn, steps, groups, scm, zc;
} p;

uint first_group(uint step, uint total) {   // the workgroup whose steps hold `step`
    return ((step + 1u) * p.groups - 1u) / total;
}

void main() {
    uint quads = p.N / 4u, slab = p.nz * p.M * quads;
    uint e = flat_index();
    if (e >= slab) return;
    uint col = e % quads * 4u, row = e / quads % p.M, z = e / (quads * p.M);
    uint tiles_m = (p.M + p.bm - 1u) / p.bm, tiles_n = (p.N + p.bn - 1u) / p.bn;
    uint tm = row / p.bm, tn = col / p.bn;
    uint t = z * tiles_m * tiles_n + (p.N >= p.M ? tm * tiles_n + tn : tn * tiles_m + tm);
    uint total = p.nz * tiles_m * tiles_n * p.steps;
    uint pieces = first_group(t * p.steps + p.steps - 1u, total) - first_group(t * p.steps, total) + 1u;
    vec4 sum = parts[e];
    for (uint s = 1u; s < pieces; ++s) sum += parts[s * slab + e];
    c[(z * p.zc + row * p.scm + col) / 4u] = STORE4(sum);
}
