// variants: f32 f16 bf16
// SGD with momentum (dampening, nesterov), one param: see flowgrad/train/optim.py
// (SGD) for the formula and the hyper layout. The momentum buffer is f32.
#version 450
#include "common.glsl"
#include "optim.glsl"
layout(local_size_x = 256) in;
layout(binding = 0) buffer Param { T p[]; };
layout(binding = 1) readonly buffer Grad { T g[]; };
layout(binding = 2) buffer Momentum { float buf[]; };
layout(binding = 3) readonly buffer Hyper { float h[]; };   // lr momentum dampening weight_decay nesterov first one_minus_dampening
layout(binding = 4) readonly buffer Scale { float clip_scale; float skip; };  // skip: the loss scaler found an overflow
layout(push_constant) uniform Push { uint n; } pc;

void main() {
    if (skip != 0.0) return;
    float lr = h[0], mom = h[1], wd = h[3];
    float undamped = h[6];   // 1 - dampening, from the host in double: 1.0 - h[2] here drops its low bits
    bool nesterov = h[4] != 0.0, first = h[5] != 0.0;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += STRIDE) {
        float w = LOAD(p[i]);
        float d = LOAD(g[i]) * clip_scale + wd * w;
        float b = first ? d : mom * buf[i] + undamped * d;
        buf[i] = b;
        d = nesterov ? d + mom * b : b;
        p[i] = STORE(w - lr * d);
    }
}
