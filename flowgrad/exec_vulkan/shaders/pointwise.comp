// variants: f32 f16 bf16
#version 450
// One map per invocation for the activations and elementwise losses that
// map_reduce.comp does not carry: out[i] = F(a[i], b[i]). Ops:
//   0 erf   2 softplus(beta=p0, threshold=p1)   4 leaky_relu(slope=p0)   6 elu(alpha=p0)
//   8 |a - b|   10 huber(a - b, delta=p0)   12 bce with logits (x=a, y=b)
// (their gradients are ops of their own); the losses' means are a
// map_reduce sum afterwards.
#include "common.glsl"
#include "fg_math.glsl"

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) readonly buffer BufA { T a[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufB { T b[]; };
layout(std430, set = 0, binding = 2) writeonly buffer BufO { T o[]; };
layout(push_constant, std430) uniform Push {
    uint n, op;
    float p0, p1;
} p;

float softplus0(float x) { return max(x, 0.0) + fg_log1p01(exp(-abs(x))); }

float f(uint op, float x, float y) {
    switch (op) {
    case 0u: return fg_erf(x);
    case 2u: return p.p0 * x > p.p1 ? x : softplus0(p.p0 * x) / p.p0;
    case 4u: return x > 0.0 ? x : p.p0 * x;
    case 6u: return x > 0.0 ? x : p.p0 * fg_expm1(x);
    case 8u: return abs(x - y);
    case 10u: { float d = abs(x - y); return d < p.p0 ? 0.5 * d * d : p.p0 * (d - 0.5 * p.p0); }
    default: return max(x, 0.0) - x * y + fg_log1p01(exp(-abs(x)));   // 12
    }
}

void main() {
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < p.n; i += step) {
        o[i] = STORE(f(p.op, LOAD(a[i]), LOAD(b[i])));  // unary ops bind a as b too
    }
}
