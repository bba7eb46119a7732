// GEMM on cooperative matrices (VK_KHR_cooperative_matrix, or with COOP_NV
// the NV extension that preceded it): f16 operands (bf16 in the BF16 builds), FR x FR x FR products
// (FR 16, or 8 where the .comp says so) accumulated in f32, f16 result. Same
// contract, push constants and epilogue (gemm_epilogue.glsl: its adds bits in
// the EPI_ADDS specialization constant) as matmul_tiled.glsl (strides,
// batches, summed batches, split-K, whose partials' sum takes the epilogue);
// the host sends only GEMMs whose M and N are multiples of 16, K a multiple
// of 8, and whose unit-stride rows start 16-byte aligned (8 f16), so tiles
// move as 16-byte vectors. Each operand's tile is kept in shared memory in
// its own memory order (k-fast or m-fast for A, n-fast or k-fast for B) and
// loaded into fragments row- or column-major to match: a transposed operand
// costs nothing. The including .comp defines WGM x WGN subgroups (of SG
// invocations, 32 unless it says otherwise) per workgroup, each computing
// FM x FN fragments; BK deep per step; NBUF shared buffers (2: the next
// step's tiles land in the other buffer, one barrier per step; 1: deeper
// steps fit, two barriers per step).
//
// A shader whose operands are not strided matrices (conv_gemm.glsl: image
// patches gathered on the fly) defines GEMM_OPERANDS, its own buffers (f16
// storage) and push block, and the hooks matmul_tiled.glsl takes: the sizes
// (GEMM_M, GEMM_N, GEMM_K, GEMM_NZ, GEMM_R, GEMM_KEND), each operand's memory
// order (A_KFAST, B_NFAST), bases (A_BASE, B_BASE), elements (a_at, b_at) and
// the store of one output element (store_c), and with GEMM_RUNS runs of 8
// elements along the load order (a_run, b_run). Such operands have no 16-byte
// vectors: each shared vector is 8 scalars gathered (zero outside M, N and
// the depth) and packed, and each output fragment goes through shared memory
// to store_c, element by element; so any M, N and K work (padded to the
// fragments), where plain GEMMs keep the alignment rules above.
#ifdef COOP_NV
#extension GL_NV_cooperative_matrix : require
#define H float16_t
#define FRAG_A fcoopmatNV<16, gl_ScopeSubgroup, FR, FR>
#define FRAG_B FRAG_A
#define FRAG_ACC fcoopmatNV<32, gl_ScopeSubgroup, FR, FR>
#define FRAG_OUT FRAG_A
#define LOAD_ROWS(f, buf, at, stride) coopMatLoadNV(f, buf, at, stride, false)
#define LOAD_COLS(f, buf, at, stride) coopMatLoadNV(f, buf, at, stride, true)
#define STORE_FRAG(f, buf, at, stride) coopMatStoreNV(f, buf, at, stride, false)
#define MUL_ADD(a, b, c) coopMatMulAddNV(a, b, c)
#else
#extension GL_KHR_cooperative_matrix : require
// H: the operands' and the result's type, f16, or bf16 where BF16 is defined
// (GL_EXT_bfloat16: VK_KHR_shader_bfloat16's cooperative matrices); the products
// accumulate in f32 either way
#ifdef BF16
#extension GL_EXT_bfloat16 : require
#define H bfloat16_t
#else
#define H float16_t
#endif
#define FRAG_A coopmat<H, gl_ScopeSubgroup, FR, FR, gl_MatrixUseA>
#define FRAG_B coopmat<H, gl_ScopeSubgroup, FR, FR, gl_MatrixUseB>
#define FRAG_ACC coopmat<float, gl_ScopeSubgroup, FR, FR, gl_MatrixUseAccumulator>
#define FRAG_OUT coopmat<H, gl_ScopeSubgroup, FR, FR, gl_MatrixUseAccumulator>
#define LOAD_ROWS(f, buf, at, stride) coopMatLoad(f, buf, at, stride, gl_CooperativeMatrixLayoutRowMajor)
#define LOAD_COLS(f, buf, at, stride) coopMatLoad(f, buf, at, stride, gl_CooperativeMatrixLayoutColumnMajor)
#define STORE_FRAG(f, buf, at, stride) coopMatStore(f, buf, at, stride, gl_CooperativeMatrixLayoutRowMajor)
#define MUL_ADD(a, b, c) coopMatMulAdd(a, b, c)
#endif
#ifndef FR
#define FR 16                     // fragments of FR x FR, products FR deep
#endif
#ifndef SG
#define SG 32                     // invocations per subgroup
#endif
#define FRU uint(FR)
#define SGU uint(SG)
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require

#define BM (WGM * FM * FR)
#define BN (WGN * FN * FR)
#define NT (WGM * WGN * SG)
#ifndef GROUP_M
#define GROUP_M 1             // tile rows that walk one band of B's columns together (main)
#endif
#define AV (BM * BK / 8)          // 16-byte vectors per operand tile
#define BV (BN * BK / 8)
#define AL ((AV + NT - 1) / NT)
#define BL ((BV + NT - 1) / NT)
// shared row lengths in 16-byte vectors, +1 so fragment rows fall in different banks
#define KROW (BK / 8 + 1)         // a k-fast row
#define AROW (BM / 8 + 1)         // an m-fast row of A
#define BROW (BN / 8 + 1)         // an n-fast row of B
#define ASZ (max(BM * KROW, BK * AROW))
#define BSZ (max(BN * KROW, BK * BROW))

layout(local_size_x = NT) in;
#ifndef GEMM_OPERANDS
layout(std430, set = 0, binding = 0) readonly buffer BufA { uvec4 a8[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufB { uvec4 b8[]; };
// PARTS_F32: C holds split-K's partials in f32 (the builds named _p32), which their sum
// rounds once; such a build has no epilogue (the caller applies it after the sum)
#ifdef PARTS_F32
layout(std430, set = 0, binding = 2) writeonly buffer BufC { float c[]; };
#else
layout(std430, set = 0, binding = 2) writeonly buffer BufC { H c[]; };
#endif
#include "gemm_epilogue_buffers.glsl"
#include "gemm_push.glsl"
layout(push_constant, std430) uniform Push { GEMM_PUSH } p;   // amode, bmode, cvec unused: vectors always
#include "fg_math.glsl"
#include "map_ops.glsl"
#include "gemm_epilogue.glsl"
// the epilogue's adds bits, a specialization constant as EPI_ACT is: a product
// without an epilogue compiles with none of its code
layout(constant_id = 1) const uint EPI_ADDS = 0u;
// A build for one operand layout (FIXED_A_KFAST: A read along k, FIXED_B_NFAST: B read
// along n; each 1 or 0): the driver then compiles that layout's loads alone, without the
// branches that pick one inside the unrolled steps
#ifdef FIXED_A_KFAST
#define KFAST_A (FIXED_A_KFAST != 0)
#define NFAST_B (FIXED_B_NFAST != 0)
#endif

// 8 elements along the operand's memory order from (m, k), one 16-byte vector
// (the host checked that vectors stay inside rows and inside M, N and K)
uvec4 a_pack(uint base, uint m, uint k, uint kend) {
    uvec4 v = uvec4(0u);
    if (m < p.M && k < kend) v = a8[(base + m * p.sam + k * p.sak) / 8u];
    return v;
}
uvec4 b_pack(uint base, uint k, uint n, uint kend) {
    uvec4 v = uvec4(0u);
    if (n < p.N && k < kend) v = b8[(base + k * p.sbk + n * p.sbn) / 8u];
    return v;
}
#else
// 8 gathered elements along the operand's memory order from (m, k), each zero
// outside the product, packed as 8 f16 in memory order
uvec4 pack8(float v[8]) {
    return uvec4(packHalf2x16(vec2(v[0], v[1])), packHalf2x16(vec2(v[2], v[3])),
                 packHalf2x16(vec2(v[4], v[5])), packHalf2x16(vec2(v[6], v[7])));
}
#ifdef GEMM_RUNS
// the operand gathers 8 along the load order itself (its GEMM_RUN is 8)
uvec4 a_pack(uint base, uint m, uint k, uint kend) {
    float v[8];
    a_run(base, m, k, kend, v);
    return pack8(v);
}
uvec4 b_pack(uint base, uint k, uint n, uint kend) {
    float v[8];
    b_run(base, k, n, kend, v);
    return pack8(v);
}
#else
uvec4 a_pack(uint base, uint m, uint k, uint kend) {
    bool kfast = A_KFAST;
    float v[8];
    [[unroll]] for (uint j = 0u; j < 8u; ++j) {
        uint mm = kfast ? m : m + j, kk = kfast ? k + j : k;
        v[j] = 0.0;
        if (mm < GEMM_M && kk < kend) v[j] = a_at(base, mm, kk);
    }
    return pack8(v);
}
uvec4 b_pack(uint base, uint k, uint n, uint kend) {
    bool nfast = B_NFAST;
    float v[8];
    [[unroll]] for (uint j = 0u; j < 8u; ++j) {
        uint nn = nfast ? n + j : n, kk = nfast ? k : k + j;
        v[j] = 0.0;
        if (nn < GEMM_N && kk < kend) v[j] = b_at(base, kk, nn);
    }
    return pack8(v);
}
#endif
#endif

#ifndef KFAST_A
#define KFAST_A A_KFAST
#define NFAST_B B_NFAST
#endif
#ifndef NBUF
#define NBUF 2
#endif
shared uvec4 As[NBUF * ASZ];
shared uvec4 Bs[NBUF * BSZ];
uvec4 ra_[AL], rb_[BL];

void load_a(uint base, uint m0, uint k0, uint kend) {
    bool kfast = KFAST_A;
    [[unroll]] for (uint l = 0u; l < AL; ++l) {
        uint e = gl_LocalInvocationIndex + l * NT;
        uvec4 v = uvec4(0u);
        if (e < AV) {
            uint m, k;
            if (kfast) { m = m0 + e / (BK / 8); k = k0 + (e % (BK / 8)) * 8u; }
            else { k = k0 + e / (BM / 8); m = m0 + (e % (BM / 8)) * 8u; }
            v = a_pack(base, m, k, kend);
        }
        ra_[l] = v;
    }
}

void load_b(uint base, uint n0, uint k0, uint kend) {
    bool nfast = NFAST_B;
    [[unroll]] for (uint l = 0u; l < BL; ++l) {
        uint e = gl_LocalInvocationIndex + l * NT;
        uvec4 v = uvec4(0u);
        if (e < BV) {
            uint n, k;
            if (nfast) { k = k0 + e / (BN / 8); n = n0 + (e % (BN / 8)) * 8u; }
            else { n = n0 + e / (BK / 8); k = k0 + (e % (BK / 8)) * 8u; }
            v = b_pack(base, k, n, kend);
        }
        rb_[l] = v;
    }
}

void store_tiles(uint buf) {
    bool kfast = KFAST_A, nfast = NFAST_B;
    [[unroll]] for (uint l = 0u; l < AL; ++l) {
        uint e = gl_LocalInvocationIndex + l * NT;
        if (e >= AV) continue;
        uint at = kfast ? (e / (BK / 8)) * KROW + e % (BK / 8) : (e / (BM / 8)) * AROW + e % (BM / 8);
        As[buf * ASZ + at] = ra_[l];
    }
    [[unroll]] for (uint l = 0u; l < BL; ++l) {
        uint e = gl_LocalInvocationIndex + l * NT;
        if (e >= BV) continue;
        uint at = nfast ? (e / (BN / 8)) * BROW + e % (BN / 8) : (e / (BK / 8)) * KROW + e % (BK / 8);
        Bs[buf * BSZ + at] = rb_[l];
    }
}

#ifndef GEMM_OPERANDS
// v rounded to f16, as a dispatch would store it, and read back
FRAG_ACC rounded(FRAG_ACC v) { return FRAG_ACC(FRAG_OUT(v)); }

// v + t (an f16 fragment), rounded: element by element in one fragment type, whose
// elements each invocation holds in one order (Debian bookworm's glslc crashes
// optimizing the NV extension's whole-fragment add)
#define PLUS(v, t) { FRAG_ACC w = FRAG_ACC(t); for (int e = 0; e < v.length(); ++e) v[e] += w[e]; v = rounded(v); }
// the bias over the fragment's columns from n: a fragment loaded with stride 0 has bias[n ..] in every row
#define PLUS_BIAS(v, n) { FRAG_OUT t; LOAD_ROWS(t, bias, n, 0u); PLUS(v, t) }

// gemm_epilogue.glsl's epilogue on the output fragment at element `at` of C,
// column n, as whole fragments: where an element sits in a fragment is the
// driver's choice, so the adds read fragments laid out as this one, and the
// activation, which needs no position, runs element by element
FRAG_ACC epilogue(FRAG_ACC v, uint at, uint n) {
    v = rounded(v);
    if ((EPI_ADDS & 6u) == 6u) PLUS_BIAS(v, n)
    if ((EPI_ADDS & 1u) != 0u) {
        FRAG_OUT r;
        LOAD_ROWS(r, res, at, p.scm);
        PLUS(v, r)
    }
    if ((EPI_ADDS & 6u) == 2u) PLUS_BIAS(v, n)
    if (EPI_ACT != 0u) {
        FRAG_OUT h = FRAG_OUT(v);
        STORE_FRAG(h, pre, at, p.scm);
        for (int e = 0; e < v.length(); ++e) v[e] = epi_act(v[e]);
    }
    return v;
}
#endif

// acc += the tile's product over K steps from abase, bbase (kend deep, `steps` steps of BK), the
// tiles staged through shared memory: the text of main's loop, a macro so that the stream-K main
// below runs the same one
#define K_STEPS(abase, bbase, kend, steps) \
            load_a(abase, m0, 0u, kend); \
            load_b(bbase, n0, 0u, kend); \
            store_tiles(0u); \
            barrier(); \
            for (uint s = 0u; s < steps; ++s) { \
                uint cur = NBUF == 1 ? 0u : s & 1u; \
                bool more = s + 1u < steps; \
                if (more) { \
                    load_a(abase, m0, (s + 1u) * BK, kend); \
                    load_b(bbase, n0, (s + 1u) * BK, kend); \
                } \
                [[unroll]] for (uint kk = 0u; kk < BK; kk += FRU) { \
                    FRAG_A fa[FM]; \
                    FRAG_B fb[FN]; \
                    [[unroll]] for (uint i = 0u; i < FM; ++i) { \
                        uint row = (wm * FM + i) * FRU; \
                        if (kfast) LOAD_ROWS(fa[i], As, cur * ASZ + row * KROW + kk / 8u, KROW); \
                        else LOAD_COLS(fa[i], As, cur * ASZ + kk * AROW + row / 8u, AROW); \
                    } \
                    [[unroll]] for (uint j = 0u; j < FN; ++j) { \
                        uint col = (wn * FN + j) * FRU; \
                        if (nfast) LOAD_ROWS(fb[j], Bs, cur * BSZ + kk * BROW + col / 8u, BROW); \
                        else LOAD_COLS(fb[j], Bs, cur * BSZ + col * KROW + kk / 8u, KROW); \
                    } \
                    [[unroll]] for (uint i = 0u; i < FM; ++i) \
                        [[unroll]] for (uint j = 0u; j < FN; ++j) acc[i][j] = MUL_ADD(fa[i], fb[j], acc[i][j]); \
                } \
                if (more) { \
                    if (NBUF == 1) barrier(); \
                    store_tiles(NBUF == 1 ? 0u : cur ^ 1u); \
                } \
                barrier(); \
            }

#ifndef STREAM_K
void main() {
    uint warp = gl_LocalInvocationIndex / SGU;
    uint wm = warp / WGN, wn = warp % WGN;
#if GROUP_M == 1
    uint m0 = gl_WorkGroupID.y * BM, n0 = gl_WorkGroupID.x * BN;
#else
    // GROUP_M consecutive workgroups walk down one band of B's columns together,
    // so that band stays in L2 while A's rows stream past
    uint tiles_n = gl_NumWorkGroups.x, tiles_m = gl_NumWorkGroups.y;
    uint linear = gl_WorkGroupID.y * tiles_n + gl_WorkGroupID.x;
    uint first = linear / (uint(GROUP_M) * tiles_n) * uint(GROUP_M);
    uint rows = min(tiles_m - first, uint(GROUP_M));
    uint within = linear % (uint(GROUP_M) * tiles_n);
    uint m0 = (first + within % rows) * BM, n0 = within / rows * BN;
#endif
    bool kfast = KFAST_A, nfast = NFAST_B;
    for (uint z = gl_WorkGroupID.z; z < GEMM_NZ; z += gl_NumWorkGroups.z) {
        FRAG_ACC acc[FM][FN];
        [[unroll]] for (uint i = 0u; i < FM; ++i)
            [[unroll]] for (uint j = 0u; j < FN; ++j) acc[i][j] = FRAG_ACC(0.0);
        uint kend = GEMM_KEND(z);
        uint steps = (kend + BK - 1u) / BK;
        for (uint r = 0u; r < GEMM_R; ++r) {
            uint abase = A_BASE(z, r);
            uint bbase = B_BASE(z, r);
            K_STEPS(abase, bbase, kend, steps)
        }
#ifdef GEMM_OPERANDS
        // Each fragment goes through this subgroup's FR x FR f32 slot of As (FR * FR / 4
        // vectors; As holds all NT / SG slots, and is free: the last step's
        // barrier has passed) to store_c. Every invocation runs every fragment,
        // so the barriers are uniform.
        uint slot = warp * (FRU * FRU / 4u), lane = gl_LocalInvocationIndex % SGU;
        [[unroll]] for (uint i = 0u; i < FM; ++i) {
            uint m = m0 + (wm * FM + i) * FRU;
            [[unroll]] for (uint j = 0u; j < FN; ++j) {
                uint n = n0 + (wn * FN + j) * FRU;
                STORE_FRAG(acc[i][j], As, slot, FRU / 4u);
                barrier();
                [[unroll]] for (uint q = 0u; q < FRU * FRU / SGU; ++q) {
                    uint row = q * (SGU / FRU) + lane / FRU, col = lane % FRU;
                    if (m + row < GEMM_M && n + col < GEMM_N)
                        store_c(z, m + row, n + col, uintBitsToFloat(As[slot + row * (FRU / 4u) + col / 4u][col % 4u]));
                }
                barrier();
            }
        }
#else
        uint cbase = p.offc + z * p.zc;
        [[unroll]] for (uint i = 0u; i < FM; ++i) {
            uint m = m0 + (wm * FM + i) * FRU;
            [[unroll]] for (uint j = 0u; j < FN; ++j) {
                uint n = n0 + (wn * FN + j) * FRU;
                if (m < p.M && n < p.N) {
                    uint at = cbase + m * p.scm + n;
#ifdef PARTS_F32
                    STORE_FRAG(acc[i][j], c, at, p.scm);
#else
                    if (EPI_ADDS != 0u || EPI_ACT != 0u) acc[i][j] = epilogue(acc[i][j], at, n);
                    FRAG_OUT h = FRAG_OUT(acc[i][j]);
                    STORE_FRAG(h, c, at, p.scm);
#endif
                }
            }
        }
#endif
    }
}
#else
#include "gemm_stream.glsl"

void main() {
    uint warp = gl_LocalInvocationIndex / SGU;
    uint wm = warp / WGN, wn = warp % WGN;
    bool kfast = KFAST_A, nfast = NFAST_B;
    STREAM_RANGE(first, end)
    for (uint u = first; u < end; ) {
        Piece q = stream_piece(u, end);
        uint m0 = q.m0, n0 = q.n0, kend = min(p.K - q.k0, q.steps * BK);
        FRAG_ACC acc[FM][FN];
        [[unroll]] for (uint i = 0u; i < FM; ++i)
            [[unroll]] for (uint j = 0u; j < FN; ++j) acc[i][j] = FRAG_ACC(0.0);
        uint abase = A_BASE(q.z, 0u) + q.k0 * p.sak, bbase = B_BASE(q.z, 0u) + q.k0 * p.sbk;
        K_STEPS(abase, bbase, kend, q.steps)
        [[unroll]] for (uint i = 0u; i < FM; ++i)
            [[unroll]] for (uint j = 0u; j < FN; ++j) {
                uint m = m0 + (wm * FM + i) * FRU, n = n0 + (wn * FN + j) * FRU;
                if (m < p.M && n < p.N) STORE_FRAG(acc[i][j], c, q.cbase + m * p.scm + n, p.scm);
            }
        u += q.steps;
    }
}
#endif
