// variants: f32 f16 bf16
#version 450
// out[n, d] = table[ids[n], d]; an id outside [0, rows) is never read: it
// gives a zero row, and the smallest such position n lands in `bad` (a
// shader cannot raise; the host reads `bad` back and raises, index_checks.py).
#include "common.glsl"

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) readonly buffer Ids { int ids[]; };
layout(std430, set = 0, binding = 1) readonly buffer Table { T table[]; };
layout(std430, set = 0, binding = 2) writeonly buffer Out { T outv[]; };
layout(std430, set = 0, binding = 3) buffer Bad { uint bad; };
layout(push_constant, std430) uniform Push { uint n, d, rows; } p;

void main() {
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < p.n * p.d; i += step) {
        int id = ids[i / p.d];
        // (stored in each branch: bf16's uint16_t may be loaded and stored, not held in a variable)
        if (id >= 0 && uint(id) < p.rows) {
            outv[i] = table[uint(id) * p.d + i % p.d];
        } else {
            outv[i] = STORE(0.0);
            if (i % p.d == 0u) atomicMin(bad, i / p.d);
        }
    }
}
