// variants: f32 f16 bf16
// dst += src over n elements: gradient accumulation where a value feeds two nodes.
#version 450
#include "common.glsl"
layout(local_size_x = 256) in;
layout(binding = 0) buffer Dst { T dst[]; };
layout(binding = 1) readonly buffer Src { T src[]; };
layout(push_constant) uniform Push { uint n; } p;

void main() {
    uint i = flat_index();
    if (i < p.n) dst[i] = STORE(LOAD(dst[i]) + LOAD(src[i]));
}
