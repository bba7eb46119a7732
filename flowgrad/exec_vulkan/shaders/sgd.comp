// variants: f32 f16 bf16
// Plain SGD (no momentum), one param: see flowgrad/train/optim.py (SGD) for
// the formula and the hyper layout; the numpy update reads the same hyper array.
#version 450
#include "common.glsl"
#include "optim.glsl"
layout(local_size_x = 256) in;
layout(binding = 0) buffer Param { T p[]; };
layout(binding = 1) readonly buffer Grad { T g[]; };
layout(binding = 2) readonly buffer Hyper { float h[]; };   // lr momentum dampening weight_decay nesterov first one_minus_dampening
layout(binding = 3) readonly buffer Scale { float clip_scale; float skip; };  // skip: the loss scaler found an overflow
layout(push_constant) uniform Push { uint n; } pc;

void main() {
    if (skip != 0.0) return;
    float lr = h[0], wd = h[3];
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += STRIDE) {
        float w = LOAD(p[i]);
        float d = LOAD(g[i]) * clip_scale + wd * w;
        p[i] = STORE(w - lr * d);
    }
}
