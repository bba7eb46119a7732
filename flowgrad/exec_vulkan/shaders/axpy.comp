// variants: f32 f16 bf16
// y += a * x over n elements (a a push constant): scaled accumulation.
#version 450
#include "common.glsl"
layout(local_size_x = 256) in;
layout(binding = 0) buffer Y { T y[]; };
layout(binding = 1) readonly buffer X { T x[]; };
layout(push_constant) uniform Push { uint n; float a; } p;

void main() {
    uint i = flat_index();
    if (i < p.n) y[i] = STORE(LOAD(y[i]) + p.a * LOAD(x[i]));
}
