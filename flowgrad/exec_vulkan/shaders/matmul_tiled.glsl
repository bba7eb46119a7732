// Register-tiled GEMM, batched, operands addressed by strides (a transposed
// operand is swapped strides, never a copy):
//   C[z](m, n) = sum_{r < R} sum_k A[z, r](m, k) * B[z, r](k, n)
// The r loop sums over broadcast batch dims inside the kernel (matmul's
// backward); z runs over the output batch (stride 0 = broadcast operand).
// Split-K: with klimit != 0, z instead runs over the products' K-chunks
// of length K (the last one shorter), z = product * fixup + chunk, each
// writing a partial product into C. The last workgroup to finish an
// output tile (a per-tile counter, 0 at the start) sums the tile's
// partials in chunk order into D and applies the epilogue there: split-K
// in one dispatch, a small batch of products included, with the sum
// order, and so the result, independent of which chunk finished last.
//
// The including .comp defines the tile: BM x BN outputs per workgroup, BK
// deep per step, TM x TN outputs per invocation (multiples of 4). A thread
// owns TM/4 groups of 4 rows spaced BM/(TM/4) apart (likewise columns), so a
// warp's shared-memory reads of one k row are contiguous 16-byte vectors.
// Two shared buffers: while one step's tiles are multiplied, the next step's
// global loads are in flight in registers, then land in the other buffer, one
// barrier per step. Loads are 16-byte vectors along an operand's unit-stride
// dim when the host says the strides and sizes allow it (amode/bmode 1).
//
// The store may apply an epilogue (gemm_epilogue.glsl; the adds bits in the
// push block's epi): a matmul followed by those ops is one dispatch.
//
// A shader whose operands are not strided matrices (conv_gemm.glsl: image
// patches gathered on the fly) defines GEMM_OPERANDS, its own buffers and
// push block, and what the block below defines for matrices: the sizes,
// the depth of batch z's product (GEMM_KEND: K, or a split-K chunk's), each
// operand's memory order and elements (a_at, b_at), the vector forms
// (a_vec, b_vec, store_c4; never called where A_VEC, B_VEC, C_VEC are
// false), and the store of one output element (store_c). With GEMM_RUNS
// it also supplies a_run / b_run, 4 elements along the load order at once
// (the order its *_KFAST / *_NFAST switches give), which scalar loads use.
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

#define WN (BN / TN)            // invocations along n
#define WM (BM / TM)            // invocations along m
#define NT (WM * WN)
#define GM (TM / 4)             // 4-row groups per invocation
#define GN (TN / 4)
#ifndef PAD
#define PAD 1                   // +1 vec4 per shared row breaks bank conflicts of transposing stores
#endif
#define AW (BM / 4 + PAD)       // shared row width in vec4s
#define BW (BN / 4 + PAD)
#define AV (BM * BK / 4)        // vec4s per A tile
#define BV (BN * BK / 4)
#define AL ((AV + NT - 1) / NT) // vec4 loads per invocation
#define BL ((BV + NT - 1) / NT)

layout(local_size_x = NT) in;
#ifndef GEMM_OPERANDS
layout(std430, set = 0, binding = 0) readonly buffer BufA { T a[]; };
layout(std430, set = 0, binding = 0) readonly buffer BufA4 { T4 a4[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufB { T b[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufB4 { T4 b4[]; };
layout(std430, set = 0, binding = 2) writeonly buffer BufC { T c[]; };
layout(std430, set = 0, binding = 2) writeonly buffer BufC4 { T4 c4[]; };
layout(std430, set = 0, binding = 3) readonly buffer BufR { T res[]; };
layout(std430, set = 0, binding = 3) readonly buffer BufR4 { T4 res4[]; };
layout(std430, set = 0, binding = 4) readonly buffer BufBias { T bias[]; };
layout(std430, set = 0, binding = 4) readonly buffer BufBias4 { T4 bias4[]; };
// split-K's partials go to C through coherent stores (the fixup reads them
// back from other workgroups); the plain store stays a plain one. They are f32
// in the 16-bit builds too (the host binds f32 scratch there), so a 16-bit sum
// is rounded once, into D (the f32 build keeps T's spelling: its SPIR-V as before)
#if defined(F16) || defined(BF16)
#define PART float
#define PART4 vec4
#define PSTORE(x) (x)
#define PSTORE4(x) (x)
#define PLOAD(x) (x)
#define PLOAD4(x) (x)
#else
#define PART T
#define PART4 T4
#define PSTORE(x) STORE(x)
#define PSTORE4(x) STORE4(x)
#define PLOAD(x) LOAD(x)
#define PLOAD4(x) LOAD4(x)
#endif
layout(std430, set = 0, binding = 2) coherent writeonly buffer BufPartsW { PART parts_w[]; };
layout(std430, set = 0, binding = 2) coherent writeonly buffer BufPartsW4 { PART4 parts_w4[]; };
layout(std430, set = 0, binding = 2) coherent readonly buffer BufParts { PART parts[]; };
layout(std430, set = 0, binding = 2) coherent readonly buffer BufParts4 { PART4 parts4[]; };
layout(std430, set = 0, binding = 5) coherent buffer Counts { uint counts[]; };   // one per output tile
layout(std430, set = 0, binding = 6) writeonly buffer BufD { T d[]; };           // D(m, n) = d[m*sdm + n]
layout(std430, set = 0, binding = 6) writeonly buffer BufD4 { T4 d4[]; };
layout(std430, set = 0, binding = 7) writeonly buffer BufH { T pre[]; };
layout(std430, set = 0, binding = 7) writeonly buffer BufH4 { T4 pre4[]; };
#include "gemm_push.glsl"
layout(push_constant, std430) uniform Push {
    GEMM_PUSH             // amode, bmode 1: 16-byte loads along the unit-stride dim, 0: scalar;
                          // cvec 1: 16-byte stores of C rows
    uint epi;             // the store's adds: 1 residual, 2 bias, 4 bias first (see above)
    uint fixup;           // split-K: each product's chunks, summed into D in this dispatch (0: no split)
    uint sdm;             // D's row stride
    uint pza, pzb, pzd;   // split-K: A's, B's and D's strides from one product to the next
} p;

// z's chunk and product: without a split every z is a chunk of product 0,
// so za, zb and zc step z as the push block's comment says
#define CHUNKS (p.fixup == 0u ? p.nz : p.fixup)
#define CHUNK(z) ((z) % CHUNKS)
#define PRODUCT(z) ((z) / CHUNKS)
#undef GEMM_KEND
#define GEMM_KEND(z) (p.klimit == 0u ? p.K : min(p.K, p.klimit - CHUNK(z) * p.K))
#undef A_BASE
#define A_BASE(z, r) (p.offa + CHUNK(z) * p.za + PRODUCT(z) * p.pza + (r) * p.ra)
#undef B_BASE
#define B_BASE(z, r) (p.offb + CHUNK(z) * p.zb + PRODUCT(z) * p.pzb + (r) * p.rb)

// A pipeline specialized to its product's operand layout (LAYOUT: 16 | the
// bits below; 0: the push block says, at run time) compiles without the other
// layouts' load and store code, and without the branches choosing among them.
layout(constant_id = 1) const uint LAYOUT = 0u;
#define FIXED(bit, v) (LAYOUT != 0u ? (LAYOUT & (bit)) != 0u : (v))
#define A_VEC FIXED(1u, p.amode == 1u)
#define B_VEC FIXED(2u, p.bmode == 1u)
#undef A_KFAST
#define A_KFAST FIXED(4u, p.sak == 1u)
#undef B_NFAST
#define B_NFAST FIXED(8u, p.sbn == 1u)
#define C_VEC (p.cvec == 1u)
float a_at(uint base, uint m, uint k) { return LOAD(a[base + m * p.sam + k * p.sak]); }
float b_at(uint base, uint k, uint n) { return LOAD(b[base + k * p.sbk + n * p.sbn]); }
vec4 a_vec(uint base, uint m, uint k) { return LOAD4(a4[(base + m * p.sam + k * p.sak) / 4u]); }
vec4 b_vec(uint base, uint k, uint n) { return LOAD4(b4[(base + k * p.sbk + n * p.sbn) / 4u]); }
uint c_at(uint z, uint m, uint n) { return p.offc + z * p.zc + m * p.scm + n; }
#include "fg_math.glsl"
#include "map_ops.glsl"
#include "gemm_epilogue.glsl"
float adds(uint at, uint n, float v) {
    v = LOAD(STORE(v));
    if ((p.epi & 6u) == 6u) v = LOAD(STORE(v + LOAD(bias[n])));
    if ((p.epi & 1u) != 0u) v = LOAD(STORE(v + LOAD(res[at])));
    if ((p.epi & 6u) == 2u) v = LOAD(STORE(v + LOAD(bias[n])));
    return v;
}
vec4 adds4(uint at, uint n, vec4 v) {
    v = LOAD4(STORE4(v));
    if ((p.epi & 6u) == 6u) v = LOAD4(STORE4(v + LOAD4(bias4[n / 4u])));
    if ((p.epi & 1u) != 0u) v = LOAD4(STORE4(v + LOAD4(res4[at / 4u])));
    if ((p.epi & 6u) == 2u) v = LOAD4(STORE4(v + LOAD4(bias4[n / 4u])));
    return v;
}
#define EPILOGUE (p.epi != 0u || EPI_ACT != 0u)
// The epilogue of 4 outputs of a row from column n, element `at` of C (or
// D) on: those below N, all 4 at once where vec. The activation runs in a
// loop the compiler may leave rolled: one copy of its code per store.
vec4 epilogue(uint at, uint n, vec4 v, bool vec) {
    if (vec) {
        v = adds4(at, n, v);
    } else {
        [[unroll]] for (uint q = 0u; q < 4u; ++q)
            if (n + q < GEMM_N) v[q] = adds(at + q, n + q, v[q]);
    }
    if (EPI_ACT == 0u) return v;
    if (vec) {
        pre4[at / 4u] = STORE4(v);
    } else {
        [[unroll]] for (uint q = 0u; q < 4u; ++q)
            if (n + q < GEMM_N) pre[at + q] = STORE(v[q]);
    }
    float r[4] = float[4](v.x, v.y, v.z, v.w);
    for (uint q = 0u; q < 4u; ++q) r[q] = LOAD(STORE(epi_act(r[q])));
    return vec4(r[0], r[1], r[2], r[3]);
}
// the store's epilogue (store_acc), before store_c4 / store_c store its result
#define GEMM_EPILOGUE(z, m, n, v, vec) \
    if (p.fixup == 0u && EPILOGUE) v = epilogue(c_at(z, m, n), n, v, vec)
void store_c(uint z, uint m, uint n, float v) {
    uint at = c_at(z, m, n);
    if (p.fixup != 0u) parts_w[at] = PSTORE(v);
    else c[at] = STORE(v);
}
void store_c4(uint z, uint m, uint n, vec4 v) {
    uint at = c_at(z, m, n);
    if (p.fixup != 0u) parts_w4[at / 4u] = PSTORE4(v);
    else c4[at / 4u] = STORE4(v);
}

#endif

shared vec4 As[2][BK][AW];   // As[buf][k][m / 4], component m % 4
shared vec4 Bs[2][BK][BW];

#ifndef GEMM_OPERANDS
// After a chunk's partial tile is stored: the tile's last chunk to arrive
// sums every chunk's partial, in chunk order, into D. The flag saying so
// passes through As (idle after the K loop; a shared word more would put
// the 128x128_k16 tile over 32 KiB).
void fixup(uint z, uint m0, uint n0) {
    uint product = PRODUCT(z);
    memoryBarrierBuffer();
    barrier();
    if (gl_LocalInvocationIndex == 0u) {
        uint tile = (product * gl_NumWorkGroups.y + gl_WorkGroupID.y) * gl_NumWorkGroups.x + gl_WorkGroupID.x;
        As[0][0][0].x = atomicAdd(counts[tile], 1u) == p.fixup - 1u ? 1.0 : 0.0;
    }
    barrier();
    bool last = As[0][0][0].x != 0.0;
    barrier();   // every invocation has read the flag before As is written again
    if (!last) return;
    memoryBarrierBuffer();
    // 4 outputs of a row per invocation and step, 4 chunks' loads in flight:
    // one workgroup reads every chunk of its tile, so this tail is latency-bound
    bool vec = C_VEC && p.sdm % 4u == 0u && p.pzd % 4u == 0u;
    for (uint e = gl_LocalInvocationIndex; e < BM * BN / 4u; e += NT) {
        uint m = m0 + e / (BN / 4u), n = n0 + (e % (BN / 4u)) * 4u;
        if (m >= p.M || n >= p.N) continue;
        uint at = c_at(product * p.fixup, m, n), o = product * p.pzd + m * p.sdm + n;
        bool v4 = vec && n + 3u < p.N;
        vec4 v = vec4(0.0);
        if (v4) {
            uint z = 0u;
            for (; z + 4u <= p.fixup; z += 4u) {
                vec4 a0 = PLOAD4(parts4[(at + z * p.zc) / 4u]), a1 = PLOAD4(parts4[(at + (z + 1u) * p.zc) / 4u]);
                vec4 a2 = PLOAD4(parts4[(at + (z + 2u) * p.zc) / 4u]), a3 = PLOAD4(parts4[(at + (z + 3u) * p.zc) / 4u]);
                v = (((v + a0) + a1) + a2) + a3;
            }
            for (; z < p.fixup; ++z) v += PLOAD4(parts4[(at + z * p.zc) / 4u]);
        } else {
            [[unroll]] for (uint q = 0u; q < 4u; ++q)
                if (n + q < p.N)
                    for (uint z = 0u; z < p.fixup; ++z) v[q] += PLOAD(parts[at + q + z * p.zc]);
        }
        if (EPILOGUE) v = epilogue(o, n, v, v4);
        if (v4) {
            d4[o / 4u] = STORE4(v);
        } else {
            [[unroll]] for (uint q = 0u; q < 4u; ++q)
                if (n + q < p.N) d[o + q] = STORE(v[q]);
        }
    }
}
#endif

vec4 ra[AL], rb[BL];         // the next step's tiles, in flight

// Element e of a tile in load order: for a k-fast operand consecutive
// invocations walk k (coalesced), else they walk m (or n).
void load_a(uint base, uint m0, uint k0, uint kend) {
    bool kfast = A_KFAST;
    [[unroll]] for (uint l = 0u; l < AL; ++l) {
        uint e = gl_LocalInvocationIndex + l * NT;
        vec4 v = vec4(0.0);
        if (e < AV) {
            if (A_VEC) {
                uint mm = kfast ? e / (BK / 4) : (e % (BM / 4)) * 4u;
                uint kk = kfast ? (e % (BK / 4)) * 4u : e / (BM / 4);
                uint m = m0 + mm, k = k0 + kk;
                if (m < GEMM_M && k < kend) v = a_vec(base, m, k);
            } else {
#ifdef GEMM_RUNS
                uint f = e * 4u;
                float run[4];
                a_run(base, m0 + (kfast ? f / BK : f % BM), k0 + (kfast ? f % BK : f / BM), kend, run);
                v = vec4(run[0], run[1], run[2], run[3]);
#else
                [[unroll]] for (uint j = 0u; j < 4u; ++j) {
                    uint f = e * 4u + j;
                    uint mm = kfast ? f / BK : f % BM, kk = kfast ? f % BK : f / BM;
                    uint m = m0 + mm, k = k0 + kk;
                    if (m < GEMM_M && k < kend) v[j] = a_at(base, m, k);
                }
#endif
            }
        }
        ra[l] = v;
    }
}

void load_b(uint base, uint n0, uint k0, uint kend) {
    bool nfast = B_NFAST;
    [[unroll]] for (uint l = 0u; l < BL; ++l) {
        uint e = gl_LocalInvocationIndex + l * NT;
        vec4 v = vec4(0.0);
        if (e < BV) {
            if (B_VEC) {
                uint nn = nfast ? (e % (BN / 4)) * 4u : e / (BK / 4);
                uint kk = nfast ? e / (BN / 4) : (e % (BK / 4)) * 4u;
                uint n = n0 + nn, k = k0 + kk;
                if (n < GEMM_N && k < kend) v = b_vec(base, k, n);
            } else {
#ifdef GEMM_RUNS
                uint f = e * 4u;
                float run[4];
                b_run(base, k0 + (nfast ? f / BN : f % BK), n0 + (nfast ? f % BN : f / BK), kend, run);
                v = vec4(run[0], run[1], run[2], run[3]);
#else
                [[unroll]] for (uint j = 0u; j < 4u; ++j) {
                    uint f = e * 4u + j;
                    uint nn = nfast ? f % BN : f / BK, kk = nfast ? f / BN : f % BK;
                    uint n = n0 + nn, k = k0 + kk;
                    if (n < GEMM_N && k < kend) v[j] = b_at(base, k, n);
                }
#endif
            }
        }
        rb[l] = v;
    }
}

// The registers' layout is load_a's: a vector runs along k (k-fast, vector
// loads), along m (m-fast, vector loads), or is 4 consecutive load-order
// elements (scalar loads).
void store_a(uint buf) {
    bool kfast = A_KFAST;
    [[unroll]] for (uint l = 0u; l < AL; ++l) {
        uint e = gl_LocalInvocationIndex + l * NT;
        if (e >= AV) continue;
        if (A_VEC && !kfast) {
            As[buf][e / (BM / 4)][e % (BM / 4)] = ra[l];
        } else {
            [[unroll]] for (uint j = 0u; j < 4u; ++j) {
                uint mm, kk;
                if (A_VEC) { mm = e / (BK / 4); kk = (e % (BK / 4)) * 4u + j; }
                else { uint f = e * 4u + j; mm = kfast ? f / BK : f % BM; kk = kfast ? f % BK : f / BM; }
                As[buf][kk][mm / 4u][mm % 4u] = ra[l][j];
            }
        }
    }
}

void store_b(uint buf) {
    bool nfast = B_NFAST;
    [[unroll]] for (uint l = 0u; l < BL; ++l) {
        uint e = gl_LocalInvocationIndex + l * NT;
        if (e >= BV) continue;
        if (B_VEC && nfast) {
            Bs[buf][e / (BN / 4)][e % (BN / 4)] = rb[l];
        } else {
            [[unroll]] for (uint j = 0u; j < 4u; ++j) {
                uint nn, kk;
                if (B_VEC) { nn = e / (BK / 4); kk = (e % (BK / 4)) * 4u + j; }
                else { uint f = e * 4u + j; nn = nfast ? f % BN : f / BK; kk = nfast ? f / BN : f % BK; }
                Bs[buf][kk][nn / 4u][nn % 4u] = rb[l][j];
            }
        }
    }
}

// One invocation's 4 outputs of row m from column n. The store reads acc at
// literal indices (STORE_ROWS): a store loop the driver leaves rolled would
// index acc at run time, which moves all of it to local memory (on the H200
// the 128x128 tiles ran 15x slower once the epilogue made that loop large).
void store_acc(uint z, uint m, uint n, vec4 v) {
    if (m >= GEMM_M) return;
#ifdef GEMM_EPILOGUE
    GEMM_EPILOGUE(z, m, n, v, C_VEC && n + 3u < GEMM_N);
#endif
    if (C_VEC && n + 3u < GEMM_N) {
        store_c4(z, m, n, v);
        return;
    }
    [[unroll]] for (uint q = 0u; q < 4u; ++q)
        if (n + q < GEMM_N) store_c(z, m, n + q, v[q]);
}
#define STORE_IJ(i, j) store_acc(z, m0 + ((i) / 4u) * (WM * 4u) + ty * 4u + (i) % 4u, n0 + (j) * (WN * 4u) + tx * 4u, acc[i][j])
#if GN == 1
#define STORE_ROW(i) STORE_IJ(i, 0u)
#elif GN == 2
#define STORE_ROW(i) STORE_IJ(i, 0u); STORE_IJ(i, 1u)
#else
#error "the store takes TN of 4 or 8"
#endif
#if TM == 4
#define STORE_ROWS() STORE_ROW(0u); STORE_ROW(1u); STORE_ROW(2u); STORE_ROW(3u)
#elif TM == 8
#define STORE_ROWS() STORE_ROW(0u); STORE_ROW(1u); STORE_ROW(2u); STORE_ROW(3u); \
                     STORE_ROW(4u); STORE_ROW(5u); STORE_ROW(6u); STORE_ROW(7u)
#else
#error "the store takes TM of 4 or 8"
#endif

void main() {
    uint tx = gl_LocalInvocationIndex % WN, ty = gl_LocalInvocationIndex / WN;
    uint m0 = gl_WorkGroupID.y * BM, n0 = gl_WorkGroupID.x * BN;
    for (uint z = gl_WorkGroupID.z; z < GEMM_NZ; z += gl_NumWorkGroups.z) {
        vec4 acc[TM][GN];
        [[unroll]] for (uint i = 0u; i < TM; ++i)
            [[unroll]] for (uint j = 0u; j < GN; ++j) acc[i][j] = vec4(0.0);
        uint kend = GEMM_KEND(z);
        uint steps = (kend + BK - 1u) / BK;
        for (uint r = 0u; r < GEMM_R; ++r) {
            uint abase = A_BASE(z, r);
            uint bbase = B_BASE(z, r);
            load_a(abase, m0, 0u, kend);
            load_b(bbase, n0, 0u, kend);
            store_a(0u);
            store_b(0u);
            barrier();
            for (uint s = 0u; s < steps; ++s) {
                uint cur = s & 1u;
                bool more = s + 1u < steps;
                if (more) {
                    load_a(abase, m0, (s + 1u) * BK, kend);
                    load_b(bbase, n0, (s + 1u) * BK, kend);
                }
                [[unroll]] for (uint kk = 0u; kk < BK; ++kk) {
                    vec4 av[GM], bv[GN];
                    [[unroll]] for (uint g = 0u; g < GM; ++g) av[g] = As[cur][kk][g * WM + ty];
                    [[unroll]] for (uint g = 0u; g < GN; ++g) bv[g] = Bs[cur][kk][g * WN + tx];
                    [[unroll]] for (uint i = 0u; i < TM; ++i)
                        [[unroll]] for (uint j = 0u; j < GN; ++j) acc[i][j] += av[i / 4u][i % 4u] * bv[j];
                }
                if (more) {
                    store_a(cur ^ 1u);
                    store_b(cur ^ 1u);
                }
                barrier();
            }
        }
        STORE_ROWS();
#ifndef GEMM_OPERANDS
        if (p.fixup != 0u) fixup(z, m0, n0);
#endif
    }
}
