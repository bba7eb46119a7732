// variants: f32 f16 bf16
// Loss scaling, part 1: one gradient times 1/scale, in place; flags[k] = 1
// if it holds an inf or a NaN (the flags are zeroed before, and several
// workgroups may write the same 1). As torch's
// _amp_foreach_non_finite_check_and_unscale_.
#version 450
#include "common.glsl"
#include "optim.glsl"
layout(local_size_x = 256) in;
layout(binding = 0) buffer Grad { T g[]; };
layout(binding = 1) readonly buffer Scale { float scale; float inv_scale; };
layout(binding = 2) buffer Flags { float flags[]; };
layout(push_constant) uniform Push { uint n; uint k; } pc;

void main() {
    bool bad = false;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += STRIDE) {
        float x = LOAD(g[i]);
        bad = bad || isnan(x) || isinf(x);
        g[i] = STORE(x * inv_scale);
    }
    if (bad) flags[pc.k] = 1.0;
}
