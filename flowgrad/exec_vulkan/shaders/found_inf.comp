// Loss scaling, part 2 (one workgroup): found = 1 if any gradient's flag is
// set, else 0. The optimizer skips its update when found is 1.
#version 450
layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer Flags { float flags[]; };
layout(binding = 1) buffer Found { float found; };
layout(push_constant) uniform Push { uint count; } pc;

shared float acc[256];

void main() {
    uint t = gl_LocalInvocationID.x;
    float s = 0.0;
    for (uint i = t; i < pc.count; i += 256u) s = max(s, flags[i]);
    acc[t] = s;
    barrier();
    for (uint half_ = 128u; half_ > 0u; half_ >>= 1) {
        if (t < half_) acc[t] = max(acc[t], acc[t + half_]);
        barrier();
    }
    if (t == 0u) found = acc[0];
}
