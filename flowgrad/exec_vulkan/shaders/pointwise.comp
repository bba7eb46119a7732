// variants: f32 f16
#version 450
// One map per invocation for the activations and elementwise losses that
// map_reduce.comp does not carry: out[i] = F(a[i], b[i]) * G, where G is 1
// for a forward, g[i] for an activation's backward, and g[0] * scale for a
// loss's backward (g_scalar: the loss gradient is one number). Ops:
//   0 erf         1 erf'          2 softplus(beta=p0, threshold=p1)  3 softplus'
//   4 leaky_relu(slope=p0)  5 leaky_relu'   6 elu(alpha=p0)  7 elu'
//   8 |a - b|     9 sign(a - b)  10 huber(a - b, delta=p0)  11 clamp(a - b, -delta, delta)
//  12 bce with logits (x=a, y=b)  13 its d/dx = sigmoid(x) - y   14 its d/dy = -x
// Forwards (even ops but 9, 11, 13, 14) ignore g; the losses' means are a
// map_reduce sum afterwards.
#include "common.glsl"
#include "fg_math.glsl"

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) readonly buffer BufA { T a[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufB { T b[]; };
layout(std430, set = 0, binding = 2) readonly buffer BufG { T g[]; };
layout(std430, set = 0, binding = 3) writeonly buffer BufO { T o[]; };
layout(push_constant, std430) uniform Push {
    uint n, op;
    float p0, p1, scale;
    uint g_scalar;
} p;

float sigm(float x) { return x >= 0.0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x)); }
float softplus0(float x) { return max(x, 0.0) + fg_log1p01(exp(-abs(x))); }

float f(uint op, float x, float y) {
    switch (op) {
    case 0u: return fg_erf(x);
    case 1u: return 1.1283791670955126 * exp(-x * x);
    case 2u: return p.p0 * x > p.p1 ? x : softplus0(p.p0 * x) / p.p0;
    case 3u: return p.p0 * x > p.p1 ? 1.0 : sigm(p.p0 * x);
    case 4u: return x > 0.0 ? x : p.p0 * x;
    case 5u: return x > 0.0 ? 1.0 : p.p0;
    case 6u: return x > 0.0 ? x : p.p0 * fg_expm1(x);
    case 7u: return x <= 0.0 ? p.p0 * exp(x) : 1.0;   // a NaN x passes g, as torch's elu_backward
    case 8u: return abs(x - y);
    case 9u: { float d = x - y; return d > 0.0 ? 1.0 : (d < 0.0 ? -1.0 : 0.0); }   // 0 at NaN, as torch.sgn
    case 10u: { float d = abs(x - y); return d < p.p0 ? 0.5 * d * d : p.p0 * (d - 0.5 * p.p0); }
    case 11u: { float d = x - y; return isnan(d) ? d : clamp(d, -p.p0, p.p0); }   // clamp may make NaN a bound
    case 12u: return max(x, 0.0) - x * y + fg_log1p01(exp(-abs(x)));
    case 13u: return sigm(x) - y;
    default: return -x;
    }
}

void main() {
    bool forward = p.op == 0u || p.op == 2u || p.op == 4u || p.op == 6u || p.op == 8u || p.op == 10u || p.op == 12u;
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < p.n; i += step) {
        float v = f(p.op, float(a[i]), float(b[i]));  // unary ops bind a as b too
        if (!forward) v *= (p.g_scalar != 0u ? float(g[0]) : float(g[i])) * p.scale;
        o[i] = STORE(v);
    }
}
