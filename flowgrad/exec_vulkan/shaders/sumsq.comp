// variants: f32 f16 bf16
// Gradient clipping, part 1: partial sums of squares of one grad, one per
// workgroup, written to partials[offset + group]. A fixed tree order per
// group, so the sum is deterministic.
#version 450
#include "common.glsl"
#include "optim.glsl"
layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer Grad { T g[]; };
layout(binding = 1) buffer Partials { float partials[]; };
layout(push_constant) uniform Push { uint n; uint offset; } pc;

shared float acc[256];

void main() {
    float s = 0.0;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += STRIDE) {
        float x = LOAD(g[i]);
        s += x * x;
    }
    uint t = gl_LocalInvocationID.x;
    acc[t] = s;
    barrier();
    for (uint half_ = 128u; half_ > 0u; half_ >>= 1) {
        if (t < half_) acc[t] += acc[t + half_];
        barrier();
    }
    if (t == 0u) partials[pc.offset + gl_WorkGroupID.x] = acc[0];
}
