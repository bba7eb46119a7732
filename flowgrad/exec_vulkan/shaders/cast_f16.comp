// variants: f32 bf16
#version 450
// f32 <-> f16 casts: dir 0 f32 -> f16 (round to nearest), dir 1 f16 -> f32;
// the bf16 build casts f32 <-> bf16 alike (common.glsl's STORE: ties to even).
#ifndef BF16
#define F16 1   // the half side of the plain build
#endif
#include "common.glsl"

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) buffer F32 { float a[]; };
layout(std430, set = 0, binding = 1) buffer Half { T h[]; };

layout(push_constant) uniform Push {
    uint n;
    uint dir;
} pc;

void main() {
    uint stride = gl_NumWorkGroups.x * 256u;
    for (uint k = gl_GlobalInvocationID.x; k < pc.n; k += stride) {
        if (pc.dir == 0u) h[k] = STORE(a[k]);
        else a[k] = LOAD(h[k]);
    }
}
