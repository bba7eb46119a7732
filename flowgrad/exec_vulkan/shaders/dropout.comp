// variants: f32 f16 bf16
#version 450
// dropout forward and backward (the same map: y = x * mask / (1 - p)).
// The mask is Philox4x32-10 of counter (rank * n + row * row_len + i, step, 0, 0)
// under key (seed, stream), bit for bit flowgrad.ops.random.philox4x32: element
// i is kept when the top 24 bits of the first word are >= thr. rng = [training,
// step, seed, rank, row], written by the host every step; training == 0 is the
// identity. row_len: the elements of one index of x's leading axis.
#include "common.glsl"

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) readonly buffer BufX { T x[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufRng { uint rng[]; };
layout(std430, set = 0, binding = 2) writeonly buffer BufY { T y[]; };
layout(push_constant, std430) uniform Push {
    uint n, row_len, thr, stream;
    float scale;
} p;

#include "philox.glsl"

void main() {
    bool training = rng[0] != 0u;
    uint step = rng[1], seed = rng[2], first = rng[3] * p.n + rng[4] * p.row_len;
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < p.n; i += stride) {
        float v = LOAD(x[i]);
        if (training) v = (philox4x32(uvec4(first + i, step, 0u, 0u), uvec2(seed, p.stream)).x >> 8) >= p.thr ? v * p.scale : 0.0;
        y[i] = STORE(v);
    }
}
