#version 450
// f32 <-> f16 casts: dir 0 f32 -> f16 (round to nearest), dir 1 f16 -> f32.
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) buffer F32 { float a[]; };
layout(std430, set = 0, binding = 1) buffer F16 { float16_t h[]; };

layout(push_constant) uniform Push {
    uint n;
    uint dir;
} pc;

void main() {
    uint stride = gl_NumWorkGroups.x * 256u;
    for (uint k = gl_GlobalInvocationID.x; k < pc.n; k += stride) {
        if (pc.dir == 0u) h[k] = float16_t(a[k]);
        else a[k] = float(h[k]);
    }
}
