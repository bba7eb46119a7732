// variants: f32 f16
#version 450
// Sum a tensor down to a shape it was broadcast from: each output element
// (row-major over the kept dims) sums the input over the reduced dims.
// Output contiguous; input addressed by strides (kept dims: kstride,
// reduced dims: rstride). One invocation per output element: no atomics.
#include "common.glsl"
#define MAXR 6

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) readonly buffer Src { T src[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Dst { T dst[]; };
layout(push_constant, std430) uniform Push {
    uint n_out, krank, n_red, rrank;
    uint kshape[MAXR];
    uint kstride[MAXR];
    uint rshape[MAXR];
    uint rstride[MAXR];
} p;

void main() {
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint o = gl_GlobalInvocationID.x; o < p.n_out; o += step) {
        uint r = o, base = 0;
        for (int k = int(p.krank) - 1; k >= 0; --k) {
            base += (r % p.kshape[k]) * p.kstride[k];
            r /= p.kshape[k];
        }
        float acc = 0.0;
        for (uint j = 0; j < p.n_red; ++j) {
            uint q = j, s = base;
            for (int k = int(p.rrank) - 1; k >= 0; --k) {
                s += (q % p.rshape[k]) * p.rstride[k];
                q /= p.rshape[k];
            }
            acc += float(src[s]);
        }
        dst[o] = T(acc);
    }
}
