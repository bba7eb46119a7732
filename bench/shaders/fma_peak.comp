#version 450
#extension GL_EXT_control_flow_attributes : require
// The device's f32 FMA rate: 64 independent multiply-add chains per
// invocation, `iters` steps each, no memory traffic but one store at the end.
layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) writeonly buffer Out { float o[]; };
layout(push_constant, std430) uniform Push { uint iters; float x, y; } p;

void main() {
    vec4 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = vec4(float(gl_GlobalInvocationID.x) + float(i));
    for (uint t = 0u; t < p.iters; ++t) {
        [[unroll]] for (int i = 0; i < 16; ++i) acc[i] = fma(acc[i], vec4(p.x), vec4(p.y));
    }
    vec4 s = vec4(0.0);
    for (int i = 0; i < 16; ++i) s += acc[i];
    o[gl_GlobalInvocationID.x] = s.x + s.y + s.z + s.w;
}
