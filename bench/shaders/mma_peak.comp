// compiler: glslc-2025
#version 450
// The device's rate of f16 x f16 + f32 cooperative-matrix products: each
// subgroup multiplies FM x FN pairs of 16x16 fragments `iters` times into
// FM x FN independent accumulators, no memory traffic but the fragments'
// first load and one store at the end. WG: one workgroup-scope product of
// BM x BK by BK x BN per step instead (VK_NV_cooperative_matrix2). SH: every
// step loads its FM + FN fragments from shared memory first (one of 8 slots,
// so the loads stay in the loop), as a GEMM's inner loop does: the products'
// rate when fragment loads share the SM with them.
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#ifdef WG
#extension GL_NV_cooperative_matrix2 : require
#endif
layout(local_size_x = NT) in;
layout(std430, set = 0, binding = 0) writeonly buffer Out { float o[]; };
layout(std430, set = 0, binding = 1) readonly buffer In { float16_t x[]; };
layout(push_constant, std430) uniform Push { uint iters; } p;

#ifdef WG
#define MA coopmat<float16_t, gl_ScopeWorkgroup, BM, BK, gl_MatrixUseA>
#define MB coopmat<float16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB>
#define MC coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>
void main() {
    MA a;
    MB b;
    coopMatLoad(a, x, 0, BK, gl_CooperativeMatrixLayoutRowMajor);
    coopMatLoad(b, x, 0, BN, gl_CooperativeMatrixLayoutRowMajor);
    MC acc = MC(0.0);
    for (uint t = 0u; t < p.iters; ++t) acc = coopMatMulAdd(a, b, acc);
    coopMatStore(acc, o, gl_WorkGroupID.x * BM * BN, BN, gl_CooperativeMatrixLayoutRowMajor);
}
#else
#define FA coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define FB coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define FC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#ifdef SH
#define SLOTS 8u
#define SLOT ((FM + FN) * 256u)
shared float16_t sh[SLOTS * SLOT];
#endif
void main() {
    FA a[FM];
    FB b[FN];
    FC acc[FM][FN];
    [[unroll]] for (uint i = 0u; i < FM; ++i) coopMatLoad(a[i], x, i * 256u, 16, gl_CooperativeMatrixLayoutRowMajor);
    [[unroll]] for (uint j = 0u; j < FN; ++j) coopMatLoad(b[j], x, 4096u + j * 256u, 16, gl_CooperativeMatrixLayoutRowMajor);
    [[unroll]] for (uint i = 0u; i < FM; ++i)
        [[unroll]] for (uint j = 0u; j < FN; ++j) acc[i][j] = FC(0.0);
#ifdef SH
    for (uint e = gl_LocalInvocationIndex; e < SLOTS * SLOT; e += NT) sh[e] = x[e % 16384u];
    barrier();
#endif
    for (uint t = 0u; t < p.iters; ++t) {
#ifdef SH
        uint at = (t % SLOTS) * SLOT;
        [[unroll]] for (uint i = 0u; i < FM; ++i) coopMatLoad(a[i], sh, at + i * 256u, 16, gl_CooperativeMatrixLayoutRowMajor);
        [[unroll]] for (uint j = 0u; j < FN; ++j) coopMatLoad(b[j], sh, at + (FM + j) * 256u, 16, gl_CooperativeMatrixLayoutRowMajor);
#endif
        [[unroll]] for (uint i = 0u; i < FM; ++i)
            [[unroll]] for (uint j = 0u; j < FN; ++j) acc[i][j] = coopMatMulAdd(a[i], b[j], acc[i][j]);
    }
    FC s = acc[0][0];
    [[unroll]] for (uint i = 0u; i < FM; ++i)
        [[unroll]] for (uint j = 0u; j < FN; ++j) if (i + j > 0u) s = s + acc[i][j];
    coopMatStore(s, o, gl_GlobalInvocationID.x / 32u * 256u, 16, gl_CooperativeMatrixLayoutRowMajor);
}
#endif
