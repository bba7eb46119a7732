// variants: f32 f16 bf16
// Adam and AdamW, one param: see flowgrad/train/optim.py (Adam) for the formula
// and the hyper layout. AdamW is Adam with grad_decay 0 and param_decay 1 - lr*wd.
#version 450
#include "common.glsl"
#include "optim.glsl"
layout(local_size_x = 256) in;
layout(binding = 0) buffer Param { T p[]; };
layout(binding = 1) readonly buffer Grad { T g[]; };
layout(binding = 2) buffer ExpAvg { float m[]; };
layout(binding = 3) buffer ExpAvgSq { float v[]; };
// lr beta1 beta2 eps grad_decay param_decay step_size inv_sqrt_bc2 one_minus_beta1 one_minus_beta2
layout(binding = 4) readonly buffer Hyper { float h[]; };
layout(binding = 5) readonly buffer Scale { float clip_scale; float skip; };  // skip: the loss scaler found an overflow
layout(push_constant) uniform Push { uint n; } pc;

void main() {
    if (skip != 0.0) return;
    float b1 = h[1], b2 = h[2], eps = h[3], grad_decay = h[4], param_decay = h[5];
    float step_size = h[6], inv_sqrt_bc2 = h[7];
    float c1 = h[8], c2 = h[9];   // 1 - beta, from the host in double: 1.0 - b2 here drops b2's low bits
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += STRIDE) {
        float w = LOAD(p[i]);
        float d = LOAD(g[i]) * clip_scale + grad_decay * w;
        w *= param_decay;
        float mi = b1 * m[i] + c1 * d;
        float vi = b2 * v[i] + c2 * d * d;
        m[i] = mi;
        v[i] = vi;
        p[i] = STORE(w - step_size * mi / (sqrt(vi) * inv_sqrt_bc2 + eps));
    }
}
