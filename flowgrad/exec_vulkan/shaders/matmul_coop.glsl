// GEMM on cooperative matrices (VK_NV_cooperative_matrix): f16 operands,
// 16x16x16 products accumulated in f32, f16 result. Same contract and push
// constants as matmul_tiled.glsl (strides, batches, summed batches, split-K);
// the host sends only GEMMs whose M and N are multiples of 16, K a multiple
// of 8, and whose unit-stride rows start 16-byte aligned (8 f16), so tiles
// move as 16-byte vectors. Each operand's tile is kept in shared memory in
// its own memory order (k-fast or m-fast for A, n-fast or k-fast for B) and
// loaded into fragments row- or column-major to match: a transposed operand
// costs nothing. The including .comp defines WGM x WGN subgroups (of 32) per
// workgroup, each computing FM x FN 16x16 fragments; BK deep per step; NBUF
// shared buffers (2: the next step's tiles land in the other buffer, one
// barrier per step; 1: deeper steps fit, two barriers per step).
#extension GL_NV_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require

#define BM (WGM * FM * 16)
#define BN (WGN * FN * 16)
#define NT (WGM * WGN * 32)
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
layout(std430, set = 0, binding = 0) readonly buffer BufA { uvec4 a8[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufB { uvec4 b8[]; };
layout(std430, set = 0, binding = 2) writeonly buffer BufC { float16_t c[]; };
layout(push_constant, std430) uniform Push {
    uint M, N, K;
    uint sam, sak;
    uint sbk, sbn;
    uint scm;
    uint nz, za, zb, zc;
    uint R, ra, rb;
    uint offa, offb, offc;
    uint klimit;
    uint amode, bmode, cvec;   // unused here: vectors always
} p;

#ifndef NBUF
#define NBUF 2
#endif
shared uvec4 As[NBUF * ASZ];
shared uvec4 Bs[NBUF * BSZ];
uvec4 ra_[AL], rb_[BL];

void load_a(uint base, uint m0, uint k0, uint kend) {
    bool kfast = p.sak == 1u;
    [[unroll]] for (uint l = 0u; l < AL; ++l) {
        uint e = gl_LocalInvocationIndex + l * NT;
        uvec4 v = uvec4(0u);
        if (e < AV) {
            uint m, k;
            if (kfast) { m = m0 + e / (BK / 8); k = k0 + (e % (BK / 8)) * 8u; }
            else { k = k0 + e / (BM / 8); m = m0 + (e % (BM / 8)) * 8u; }
            if (m < p.M && k < kend) v = a8[(base + m * p.sam + k * p.sak) / 8u];
        }
        ra_[l] = v;
    }
}

void load_b(uint base, uint n0, uint k0, uint kend) {
    bool nfast = p.sbn == 1u;
    [[unroll]] for (uint l = 0u; l < BL; ++l) {
        uint e = gl_LocalInvocationIndex + l * NT;
        uvec4 v = uvec4(0u);
        if (e < BV) {
            uint n, k;
            if (nfast) { k = k0 + e / (BN / 8); n = n0 + (e % (BN / 8)) * 8u; }
            else { n = n0 + e / (BK / 8); k = k0 + (e % (BK / 8)) * 8u; }
            if (n < p.N && k < kend) v = b8[(base + k * p.sbk + n * p.sbn) / 8u];
        }
        rb_[l] = v;
    }
}

void store_tiles(uint buf) {
    bool kfast = p.sak == 1u, nfast = p.sbn == 1u;
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

void main() {
    uint warp = gl_LocalInvocationIndex / 32u;
    uint wm = warp / WGN, wn = warp % WGN;
    uint m0 = gl_WorkGroupID.y * BM, n0 = gl_WorkGroupID.x * BN;
    bool kfast = p.sak == 1u, nfast = p.sbn == 1u;
    for (uint z = gl_WorkGroupID.z; z < p.nz; z += gl_NumWorkGroups.z) {
        fcoopmatNV<32, gl_ScopeSubgroup, 16, 16> acc[FM][FN];
        [[unroll]] for (uint i = 0u; i < FM; ++i)
            [[unroll]] for (uint j = 0u; j < FN; ++j) acc[i][j] = fcoopmatNV<32, gl_ScopeSubgroup, 16, 16>(0.0);
        uint kend = p.klimit == 0u ? p.K : min(p.K, p.klimit - z * p.K);
        uint steps = (kend + BK - 1u) / BK;
        for (uint r = 0u; r < p.R; ++r) {
            uint abase = p.offa + z * p.za + r * p.ra;
            uint bbase = p.offb + z * p.zb + r * p.rb;
            load_a(abase, m0, 0u, kend);
            load_b(bbase, n0, 0u, kend);
            store_tiles(0u);
            barrier();
            for (uint s = 0u; s < steps; ++s) {
                uint cur = NBUF == 1 ? 0u : s & 1u;
                bool more = s + 1u < steps;
                if (more) {
                    load_a(abase, m0, (s + 1u) * BK, kend);
                    load_b(bbase, n0, (s + 1u) * BK, kend);
                }
                [[unroll]] for (uint kk = 0u; kk < BK; kk += 16u) {
                    fcoopmatNV<16, gl_ScopeSubgroup, 16, 16> fa[FM], fb[FN];
                    [[unroll]] for (uint i = 0u; i < FM; ++i) {
                        uint row = (wm * FM + i) * 16u;
                        if (kfast) coopMatLoadNV(fa[i], As, cur * ASZ + row * KROW + kk / 8u, KROW, false);
                        else coopMatLoadNV(fa[i], As, cur * ASZ + kk * AROW + row / 8u, AROW, true);
                    }
                    [[unroll]] for (uint j = 0u; j < FN; ++j) {
                        uint col = (wn * FN + j) * 16u;
                        if (nfast) coopMatLoadNV(fb[j], Bs, cur * BSZ + kk * BROW + col / 8u, BROW, false);
                        else coopMatLoadNV(fb[j], Bs, cur * BSZ + col * KROW + kk / 8u, KROW, true);
                    }
                    [[unroll]] for (uint i = 0u; i < FM; ++i)
                        [[unroll]] for (uint j = 0u; j < FN; ++j) acc[i][j] = coopMatMulAddNV(fa[i], fb[j], acc[i][j]);
                }
                if (more) {
                    if (NBUF == 1) barrier();
                    store_tiles(NBUF == 1 ? 0u : cur ^ 1u);
                }
                barrier();
            }
        }
        uint cbase = p.offc + z * p.zc;
        [[unroll]] for (uint i = 0u; i < FM; ++i) {
            uint m = m0 + (wm * FM + i) * 16u;
            [[unroll]] for (uint j = 0u; j < FN; ++j) {
                uint n = n0 + (wn * FN + j) * 16u;
                if (m < p.M && n < p.N) {
                    fcoopmatNV<16, gl_ScopeSubgroup, 16, 16> h = fcoopmatNV<16, gl_ScopeSubgroup, 16, 16>(acc[i][j]);
                    coopMatStoreNV(h, c, cbase + m * p.scm + n, p.scm, false);
                }
            }
        }
    }
}
