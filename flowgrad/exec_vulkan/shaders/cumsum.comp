// variants: f32 f16 bf16
#version 450
// Running sums along one axis of x, laid out [outer, n, inner]: one
// invocation per (outer, inner) line walks its n elements in order (from the
// last when reverse is set), accumulating in f32.
#include "common.glsl"

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) readonly buffer X { T x[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Out { T outv[]; };
layout(push_constant, std430) uniform Push { uint lines, n, inner, reverse; } p;

void main() {
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint line = gl_GlobalInvocationID.x; line < p.lines; line += step) {
        uint base = (line / p.inner) * p.n * p.inner + line % p.inner;
        float acc = 0.0;
        for (uint j = 0u; j < p.n; ++j) {
            uint at = base + (p.reverse != 0u ? p.n - 1u - j : j) * p.inner;
            acc += LOAD(x[at]);
            outv[at] = STORE(acc);
        }
    }
}
