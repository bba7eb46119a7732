// Gradient clipping, part 2 (one workgroup): the global norm from the partial
// sums, and the factor every update multiplies its gradient by, as
// torch.nn.utils.clip_grad_norm_: min(1, max_norm / (norm + eps)).
#version 450
layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer Partials { float partials[]; };
layout(binding = 1) buffer Scale { float clip_scale; };
layout(push_constant) uniform Push { uint count; float max_norm; float eps; } pc;

shared float acc[256];

void main() {
    uint t = gl_LocalInvocationID.x;
    float s = 0.0;
    for (uint i = t; i < pc.count; i += 256u) s += partials[i];
    acc[t] = s;
    barrier();
    for (uint half_ = 128u; half_ > 0u; half_ >>= 1) {
        if (t < half_) acc[t] += acc[t + half_];
        barrier();
    }
    if (t == 0u) clip_scale = min(1.0, pc.max_norm / (sqrt(acc[0]) + pc.eps));
}
