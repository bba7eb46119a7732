// variants: f32 f16 bf16
#version 450
// argmax over one axis (length L, element stride `inner`) of x, into i32:
// the first maximum, as numpy and PyTorch. The 32-bit build reads f32 or i32
// words (is_int says which), the 16-bit builds T.
#include "common.glsl"

layout(local_size_x = 256) in;
#if defined(F16) || defined(BF16)
layout(std430, set = 0, binding = 0) readonly buffer BufX { T x[]; };
#else
layout(std430, set = 0, binding = 0) readonly buffer BufX { uint x[]; };
#endif
layout(std430, set = 0, binding = 1) writeonly buffer BufO { int o[]; };
layout(push_constant, std430) uniform Push {
    uint n_out, L, inner, is_int;
} p;

float value(uint i) {
#if defined(F16) || defined(BF16)
    return LOAD(x[i]);
#else
    return p.is_int != 0u ? float(int(x[i])) : uintBitsToFloat(x[i]);
#endif
}

void main() {
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint o_ = gl_GlobalInvocationID.x; o_ < p.n_out; o_ += step) {
        uint base = (o_ / p.inner) * p.L * p.inner + o_ % p.inner;
        float best = value(base);
        int at = 0;
        for (uint j = 1u; j < p.L; ++j) {
            float v = value(base + j * p.inner);
            if (v > best) { best = v; at = int(j); }
        }
        o[o_] = at;
    }
}
