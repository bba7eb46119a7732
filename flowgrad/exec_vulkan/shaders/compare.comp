// variants: f32 f16 bf16
#version 450
// Elementwise comparisons with numpy broadcasting (each operand read through
// its own strides over the output's index space, 0 where broadcast):
// out = (a OP b) ? 1 : 0 in the operands' dtype. op: 0 eq, 1 ne, 2 lt, 3 le,
// 4 gt, 5 ge. The 32-bit build reads and writes f32 or i32 words (is_int).
#include "common.glsl"
#define MAXR 6

layout(local_size_x = 256) in;
#if defined(F16) || defined(BF16)
#define W T
#else
#define W uint
#endif
layout(std430, set = 0, binding = 0) readonly buffer BufA { W a[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufB { W b[]; };
layout(std430, set = 0, binding = 2) writeonly buffer BufO { W o[]; };
layout(push_constant, std430) uniform Push {
    uint n, op, rank, is_int;
    uint shape[MAXR];
    uint sa[MAXR];
    uint sb[MAXR];
} p;

#if defined(F16) || defined(BF16)
#define READ(v) LOAD(v)
#else
float read(W v) { return p.is_int != 0u ? float(int(v)) : uintBitsToFloat(v); }
#define READ(v) read(v)
#endif

void main() {
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < p.n; i += step) {
        uint r = i, ia = 0u, ib = 0u;
        for (int k = int(p.rank) - 1; k >= 0; --k) {
            uint c = r % p.shape[k];
            r /= p.shape[k];
            ia += c * p.sa[k];
            ib += c * p.sb[k];
        }
        float x = READ(a[ia]), y = READ(b[ib]);
        bool t = p.op == 0u ? x == y : p.op == 1u ? x != y : p.op == 2u ? x < y
               : p.op == 3u ? x <= y : p.op == 4u ? x > y : x >= y;
#if defined(F16) || defined(BF16)
        o[i] = STORE(t ? 1.0 : 0.0);
#else
        o[i] = p.is_int != 0u ? uint(t ? 1 : 0) : floatBitsToUint(t ? 1.0 : 0.0);
#endif
    }
}
