// variants: f32 f16 bf16
#version 450
// Float <-> i32 casts (the float side is T): dir 0 float -> i32 (truncates
// toward zero, like numpy's astype), dir 1 i32 -> float. NaN and values
// outside the i32 range become INT_MIN, as numpy gives on x86: GLSL leaves
// them undefined (NVIDIA saturates, NaN to 0), and an index computed from a
// NaN must stay out of range to be caught.
#include "common.glsl"

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) buffer F { T f[]; };
layout(std430, set = 0, binding = 1) buffer I { int iv[]; };

layout(push_constant) uniform Push {
    uint n;
    uint dir;
} pc;

void main() {
    uint stride = gl_NumWorkGroups.x * 256u;
    for (uint k = gl_GlobalInvocationID.x; k < pc.n; k += stride) {
        if (pc.dir == 0u) {
            float v = LOAD(f[k]);
            iv[k] = v >= -2147483648.0 && v < 2147483648.0 ? int(v) : int(0x80000000u);
        }
        else f[k] = STORE(float(iv[k]));
    }
}
