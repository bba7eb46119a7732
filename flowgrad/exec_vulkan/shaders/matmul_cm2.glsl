// compiler: glslc-2025 (GL_NV_cooperative_matrix2 needs glslang 15 or newer)
#version 450
// GEMM on workgroup-scope cooperative matrices (VK_NV_cooperative_matrix2 with
// VK_KHR_cooperative_matrix): f16 operands, f32 accumulation, f16 result (bf16
// operands and result where BF16 is defined: VK_KHR_shader_bfloat16). Same
// contract and push constants as matmul_tiled.glsl (strides, batches, summed
// batches, split-K). Each workgroup owns one BM x BN output tile as a single
// matrix and steps K by BK with tensor-addressed loads: the operand tiles are
// described by a tensor layout (sizes and row stride) and the driver stages them
// through shared memory itself. A operand read along m (A_MFAST) or B read along
// k (B_KFAST) is loaded through a transposed view; the build table defines the
// tile (BM, BN, BK, NT invocations) and the two layout flags.
//
// Interior tiles whose strides and offsets are multiples of 8 (the host says so
// in amode) load unclamped with the stride masked to a multiple of 8, which lets
// the driver move 16-byte vectors; edge tiles and the K tail load clamped (zeros
// past the edge) and the store drops what falls outside C; interior tiles store
// unclamped, as they load (a clamped store cost GPT-2's products up to 1.4x). The
// store applies the epilogue of matmul_tiled.glsl (gemm_epilogue.glsl; its adds
// bits in the EPI_ADDS specialization constant); split-K's partials' sum takes it
// instead.
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
// H: the operands' and the result's type; the products accumulate in f32 either way
#ifdef BF16
#extension GL_EXT_bfloat16 : require
#define H bfloat16_t
#else
#define H float16_t
#endif

layout(local_size_x = NT) in;
layout(std430, set = 0, binding = 0) readonly buffer BufA { H a[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufB { H b[]; };
// PARTS_F32: C holds split-K's partials in f32 (the builds named _p32), which their sum
// rounds once; such a build has no epilogue (the caller applies it after the sum)
#ifdef PARTS_F32
layout(std430, set = 0, binding = 2) writeonly buffer BufC { float c[]; };
#else
layout(std430, set = 0, binding = 2) writeonly buffer BufC { H c[]; };
#endif
#include "gemm_epilogue_buffers.glsl"
#include "gemm_push.glsl"
// amode: every stride and offset is a multiple of 8; bmode, cvec unused
layout(push_constant, std430) uniform Push { GEMM_PUSH } p;
#include "fg_math.glsl"
#include "map_ops.glsl"
#include "gemm_epilogue.glsl"
// the epilogue's adds bits, a specialization constant as EPI_ACT is: a product
// without an epilogue compiles with none of its code
layout(constant_id = 1) const uint EPI_ADDS = 0u;

#define CLAMP gl_CooperativeMatrixClampModeConstantNV
#define ACC coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>
#define ACC16 coopmat<H, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>
#define MATA coopmat<H, gl_ScopeWorkgroup, BM, BK, gl_MatrixUseA>
#define MATB coopmat<H, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB>
#ifndef UNROLL
#define UNROLL 1u
#endif
#define GROUP_M 8u   // tile rows that walk one band of B's columns together (B's band stays in L2)

// an operand's layout is its memory order: A is [M][K] or, read along m, [K][M]
#if A_MFAST
#define A_DIMS(kend) kend, p.M
#define A_STRIDE p.sak
#define LOAD_A(mat, lay, k0) coopMatLoadTensorNV(mat, a, abase, sliceTensorLayoutNV(lay, k0, BK, m0, BM), tr)
#else
#define A_DIMS(kend) p.M, kend
#define A_STRIDE p.sam
#define LOAD_A(mat, lay, k0) coopMatLoadTensorNV(mat, a, abase, sliceTensorLayoutNV(lay, m0, BM, k0, BK))
#endif
// B is [K][N] or, read along k, [N][K]
#if B_KFAST
#define B_DIMS(kend) p.N, kend
#define B_STRIDE p.sbn
#define LOAD_B(mat, lay, k0) coopMatLoadTensorNV(mat, b, bbase, sliceTensorLayoutNV(lay, n0, BN, k0, BK), tr)
#else
#define B_DIMS(kend) kend, p.N
#define B_STRIDE p.sbk
#define LOAD_B(mat, lay, k0) coopMatLoadTensorNV(mat, b, bbase, sliceTensorLayoutNV(lay, k0, BK, n0, BN))
#endif

// gemm_epilogue.glsl's epilogue, element by element (coopMatPerElementNV gives
// each element's row and column in the tile m0, n0), every step rounded to H
float plus_bias(const in uint row, const in uint col, const in float v, const in uint n0) {
    uint n = n0 + col;
    return n < p.N ? float(H(v + float(bias[n]))) : v;
}
float activation(const in uint row, const in uint col, const in float v) { return epi_act(v); }

// the epilogue's adds on v, every step rounded to H (r: the residual's tile, where EPI_ADDS has it)
ACC adds(ACC v, ACC16 r, uint n0) {
    v = ACC(ACC16(v));
    if ((EPI_ADDS & 6u) == 6u) coopMatPerElementNV(v, v, plus_bias, n0);
    if ((EPI_ADDS & 1u) != 0u) v = ACC(ACC16(v + ACC(r)));
    if ((EPI_ADDS & 6u) == 2u) coopMatPerElementNV(v, v, plus_bias, n0);
    return v;
}

// The epilogue and the store of the output tile at m0, n0 through C's tensor layout `lay` (the
// residual shares C's layout; h, the pre-activation value, too). A macro, not a function: an
// interior tile passes a plain layout and an edge tile a clamped one, which are different types
#ifdef PARTS_F32
#define FINISH(lay) coopMatStoreTensorNV(acc, c, cbase, sliceTensorLayoutNV(lay, m0, BM, n0, BN));
#else
#define FINISH(lay) { \
    ACC16 r = ACC16(0.0); \
    if ((EPI_ADDS & 1u) != 0u) coopMatLoadTensorNV(r, res, cbase, sliceTensorLayoutNV(lay, m0, BM, n0, BN)); \
    if (EPI_ADDS != 0u || EPI_ACT != 0u) acc = adds(acc, r, n0); \
    if (EPI_ACT != 0u) { \
        coopMatStoreTensorNV(ACC16(acc), pre, cbase, sliceTensorLayoutNV(lay, m0, BM, n0, BN)); \
        coopMatPerElementNV(acc, acc, activation); \
    } \
    coopMatStoreTensorNV(ACC16(acc), c, cbase, sliceTensorLayoutNV(lay, m0, BM, n0, BN)); }
#endif

// acc += the tile's product over kend of K from abase, bbase (main's loop, a macro so that the
// stream-K main below runs the same one); UNROLL steps per iteration of the unclamped loop: their
// loads can be issued ahead of the products
#define K_STEPS(kend) \
            uint k0 = 0u; \
            if (fast) { \
                tensorLayoutNV<2> la = createTensorLayoutNV(2); \
                la = setTensorLayoutDimensionNV(la, A_DIMS(kend)); \
                la = setTensorLayoutStrideNV(la, A_STRIDE & ~7u, 1); \
                tensorLayoutNV<2> lb = createTensorLayoutNV(2); \
                lb = setTensorLayoutDimensionNV(lb, B_DIMS(kend)); \
                lb = setTensorLayoutStrideNV(lb, B_STRIDE & ~7u, 1); \
                uint whole = kend / (UNROLL * BK) * (UNROLL * BK); \
                for (; k0 < whole; k0 += UNROLL * BK) { \
                    [[unroll]] for (uint u = 0u; u < UNROLL; ++u) { \
                        MATA ma; \
                        MATB mb; \
                        LOAD_A(ma, la, k0 + u * BK); \
                        LOAD_B(mb, lb, k0 + u * BK); \
                        acc = coopMatMulAdd(ma, mb, acc); \
                    } \
                } \
            } \
            if (k0 < kend) { \
                tensorLayoutNV<2, CLAMP> la = createTensorLayoutNV(2, CLAMP); \
                la = setTensorLayoutDimensionNV(la, A_DIMS(kend)); \
                la = setTensorLayoutStrideNV(la, A_STRIDE, 1); \
                la = setTensorLayoutClampValueNV(la, 0u); \
                tensorLayoutNV<2, CLAMP> lb = createTensorLayoutNV(2, CLAMP); \
                lb = setTensorLayoutDimensionNV(lb, B_DIMS(kend)); \
                lb = setTensorLayoutStrideNV(lb, B_STRIDE, 1); \
                lb = setTensorLayoutClampValueNV(lb, 0u); \
                for (; k0 < kend; k0 += BK) { \
                    MATA ma; \
                    MATB mb; \
                    LOAD_A(ma, la, k0); \
                    LOAD_B(mb, lb, k0); \
                    acc = coopMatMulAdd(ma, mb, acc); \
                } \
            }

// the tile's epilogue and store at cbase (main's, a macro as K_STEPS is): interior tiles through a
// plain layout (C's stride a multiple of 8, as the operands' are), edge tiles a clamped one (zeros
// past C's edge for the residual's load; the stores drop what falls there)
#define STORE_TILE \
        if (fast) { \
            tensorLayoutNV<2> lf = createTensorLayoutNV(2); \
            lf = setTensorLayoutDimensionNV(lf, p.M, p.N); \
            lf = setTensorLayoutStrideNV(lf, p.scm & ~7u, 1); \
            FINISH(lf) \
        } else { \
            tensorLayoutNV<2, CLAMP> lc = createTensorLayoutNV(2, CLAMP); \
            lc = setTensorLayoutDimensionNV(lc, p.M, p.N); \
            lc = setTensorLayoutStrideNV(lc, p.scm, 1); \
            lc = setTensorLayoutClampValueNV(lc, 0u); \
            FINISH(lc) \
        }

#ifndef STREAM_K
void main() {
    // grouped tile order: GROUP_M consecutive workgroups share one column band
    uint tiles_n = gl_NumWorkGroups.x, tiles_m = gl_NumWorkGroups.y;
    uint linear = gl_WorkGroupID.y * tiles_n + gl_WorkGroupID.x;
    uint first = linear / (GROUP_M * tiles_n) * GROUP_M;
    uint rows = min(tiles_m - first, GROUP_M);
    uint within = linear % (GROUP_M * tiles_n);
    uint m0 = (first + within % rows) * BM, n0 = within / rows * BN;
    bool fast = p.amode != 0u && m0 + BM <= p.M && n0 + BN <= p.N;
    tensorViewNV<2, false, 1, 0> tr = createTensorViewNV(2, false, 1, 0);
    for (uint z = gl_WorkGroupID.z; z < p.nz; z += gl_NumWorkGroups.z) {
        uint kend = p.klimit == 0u ? p.K : min(p.K, p.klimit - z * p.K);
        ACC acc = ACC(0.0);
        for (uint r = 0u; r < p.R; ++r) {
            uint abase = p.offa + z * p.za + r * p.ra;
            uint bbase = p.offb + z * p.zb + r * p.rb;
            K_STEPS(kend)
        }
        uint cbase = p.offc + z * p.zc;
        STORE_TILE
    }
}
#else
#include "gemm_stream.glsl"

void main() {
    tensorViewNV<2, false, 1, 0> tr = createTensorViewNV(2, false, 1, 0);
    STREAM_RANGE(first, end)
    for (uint u = first; u < end; ) {
        Piece q = stream_piece(u, end);
        uint m0 = q.m0, n0 = q.n0, kend = min(p.K - q.k0, q.steps * BK);
        bool fast = p.amode != 0u && m0 + BM <= p.M && n0 + BN <= p.N;
        ACC acc = ACC(0.0);
        uint abase = p.offa + q.z * p.za + q.k0 * p.sak, bbase = p.offb + q.z * p.zb + q.k0 * p.sbk;
        K_STEPS(kend)
        uint cbase = q.cbase;
        STORE_TILE
        u += q.steps;
    }
}
#endif
