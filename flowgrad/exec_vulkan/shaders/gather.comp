// variants: f32 f16 bf16
#version 450
// Reads and writes at i32 indices along one axis; x and out are laid out
// [outer, n, inner] along it, index and src [outer, m, inner]:
//   mode 0 gather:      out[o, j, k] = x[o, index[o, j, k], k]
//   mode 1 scatter_add: out[o, v, k] = x[o, v, k] + the sum of src[o, j, k] over the j with
//                       index[o, j, k] == v, in order of j: one writer per output element,
//                       so no atomics and a fixed order (deterministic)
//   mode 2 one_hot:     out[i, c] = index[i] == c ? 1 : 0 (outer = items, m = inner = 1)
// An index outside [0, n) is never followed, and the smallest position of
// one lands in `bad` (a shader cannot raise; the host reads `bad` back and
// raises, index_checks.py).
#include "common.glsl"

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) readonly buffer Index { int index[]; };
layout(std430, set = 0, binding = 1) readonly buffer X { T x[]; };
layout(std430, set = 0, binding = 2) readonly buffer Src { T src[]; };
layout(std430, set = 0, binding = 3) writeonly buffer Out { T outv[]; };
layout(std430, set = 0, binding = 4) buffer Bad { uint bad; };
layout(push_constant, std430) uniform Push { uint total, n, m, inner, mode; } p;

bool outside(int id) { return id < 0 || uint(id) >= p.n; }

void main() {
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < p.total; i += step) {
        if (p.mode == 0u) {
            int id = index[i];
            uint o = i / (p.m * p.inner), k = i % p.inner;
            if (outside(id)) {
                outv[i] = STORE(0.0);
                atomicMin(bad, i);
            } else {
                outv[i] = x[(o * p.n + uint(id)) * p.inner + k];
            }
        } else if (p.mode == 1u) {
            uint o = i / (p.n * p.inner), v = (i / p.inner) % p.n, k = i % p.inner;
            float acc = LOAD(x[i]);
            for (uint j = 0u; j < p.m; ++j) {
                uint at = (o * p.m + j) * p.inner + k;
                int id = index[at];
                if (id == int(v)) acc += LOAD(src[at]);
                else if (v == 0u && outside(id)) atomicMin(bad, at);
            }
            outv[i] = STORE(acc);
        } else {
            int id = index[i / p.n];
            uint c = i % p.n;
            outv[i] = STORE(id == int(c) ? 1.0 : 0.0);
            if (c == 0u && outside(id)) atomicMin(bad, i / p.n);
        }
    }
}
