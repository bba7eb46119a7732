// variants: f32 f16 bf16
#version 450
// randn_like: standard normal noise, element i from Philox4x32-10 of counter
// (rank * n + row * row_len + i, step, 1, 0) under key (seed, stream) (the 1
// keeps its words apart from dropout's), by Box-Muller on its first two words,
// as flowgrad.ops.random.normal_noise computes it in float64.
// rng = [training, step, seed, rank, row]; training is not read: it samples in
// eval too. row_len: the elements of one index of the output's leading axis.
#include "common.glsl"

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) readonly buffer BufRng { uint rng[]; };
layout(std430, set = 0, binding = 1) writeonly buffer BufY { T y[]; };
layout(push_constant, std430) uniform Push {
    uint n, row_len, stream;
} p;

#include "fg_math.glsl"
#include "philox.glsl"

const float FG_TWO_PI = 6.28318530717958648;
const float FG_LN2_HI = 0.693145751953125;
const float FG_LN2_LO = 1.42860682030941723e-6;

// log u for u in (0, 1], with relative accuracy near 1 too, where GLSL's log
// promises only 2^-21 absolute and the radius sqrt(-2 log u) would lose every
// digit: u = m 2^e with m in [sqrt(1/2), sqrt(2)), the log1p series on m - 1.
float log_unit(float u) {
    int e;
    float m = frexp(u, e);
    if (m < 0.70710678) { m *= 2.0; e -= 1; }
    return float(e) * FG_LN2_HI + (float(e) * FG_LN2_LO + fg_log1p01(m - 1.0));
}

void main() {
    uint step = rng[1], seed = rng[2], first = rng[3] * p.n + rng[4] * p.row_len;
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < p.n; i += stride) {
        uvec4 w = philox4x32(uvec4(first + i, step, 1u, 0u), uvec2(seed, p.stream));
        float u1 = float((w.x >> 8) + 1u) * 5.9604644775390625e-8;   // (0, 1]: the log is finite
        float u2 = float(w.y >> 8) * 5.9604644775390625e-8;          // [0, 1)
        y[i] = STORE(sqrt(-2.0 * log_unit(u1)) * fg_sincos(FG_TWO_PI * u2).y);
    }
}
