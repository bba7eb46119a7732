// The attention kernels on cooperative matrices (VK_KHR_cooperative_matrix,
// subgroup scope; f16 storage, or bf16 where BF16 is defined (VK_KHR_shader_bfloat16's
// fragments), f32 accumulation): attn_coop_fwd,
// attn_coop_bwd_dq and attn_coop_bwd_dkdv, with the same contract as the
// scalar kernels (attn_common.glsl). The build table in attention_builds.py
// gives:
//   MAXD  head-width bound: head rows are staged zero-padded to MAXD columns
//   FR    fragment size: FR x FR x FR products (16 on NVIDIA, 8 on lavapipe)
//   SG    subgroup size the build assumes (the lowering checks the device's)
//   NSG   subgroups per workgroup; subgroup s owns rows s*FR .. s*FR+FR-1 of
//         the workgroup's BR = NSG*FR (queries; keys in the dk/dv pass)
//   BC    streamed rows (keys, or queries in the dk/dv pass) per shared tile
// Products run on fragments: the own rows' head rows are A fragments held
// for the whole kernel; a streamed tile is staged in shared memory and read
// as B fragments, row-major or transposed (column-major) at no cost. What is
// not a product (masking, exponentials, row statistics) runs on scalars: a
// subgroup stores its score fragments to its own rows of shared memory,
// and LPR = SG/FR lanes of it take each row.
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#ifdef CM2
#extension GL_NV_cooperative_matrix2 : require
#endif
#define BR (NSG * FR)
#define NT (NSG * SG)
layout(local_size_x = NT) in;   // declared before common.glsl's flat_index reads it (glslang 16 insists)
#include "attn_common.glsl"
// HT: the fragments' and the staged tiles' half type (T holds bf16 as its bits: uint16_t)
#ifdef BF16
#extension GL_EXT_bfloat16 : require
#define HT bfloat16_t
#else
#define HT float16_t
#endif

#define LPR (SG / FR)          // lanes per row in the scalar phases
#define ND (MAXD / FR)         // fragments across a head row
#define NB (BC / FR)           // fragments across a streamed tile
#define HROW (MAXD / 8 + 1)    // a staged head row, in 16-byte vectors (+1: rows start in other banks)
#define SROW (BC + 4)          // a row of scores, in floats
#ifndef PROW
#define PROW (BC + 8)          // a row of f16 probabilities (or their gradients), in halves
#endif
#define PER_LANE (BC / LPR)    // a lane's columns of its row: part + LPR * x

#if SG % FR != 0 || MAXD % FR != 0 || BC % FR != 0 || 2 * BC < BR
#error "attention tile: FR must divide SG, MAXD and BC, and two streamed tiles must hold the own rows"
#endif

#define FRAG_A coopmat<HT, gl_ScopeSubgroup, FR, FR, gl_MatrixUseA>
#define FRAG_B coopmat<HT, gl_ScopeSubgroup, FR, FR, gl_MatrixUseB>
#define FRAG_C coopmat<float, gl_ScopeSubgroup, FR, FR, gl_MatrixUseAccumulator>
#define ROWS gl_CooperativeMatrixLayoutRowMajor
#define COLS gl_CooperativeMatrixLayoutColumnMajor

// 8 halves at a time where every head row starts 16-byte aligned (bf16: their bits)
layout(std430, set = 0, binding = 0) readonly buffer Q8 { uvec4 q8[]; };
layout(std430, set = 0, binding = 1) readonly buffer K8 { uvec4 k8[]; };
layout(std430, set = 0, binding = 2) readonly buffer V8 { uvec4 v8[]; };

// Element e of any accumulator fragment lies in row RowIds-fragment[e] and
// column ColIds-fragment[e], whatever layout the implementation gives
// fragments: element-wise work that needs an element's row or column reads
// them from these two fragments.
shared float RowIds[FR * FR];           // RowIds[r * FR + c] = r
shared float ColIds[FR * FR];           // ColIds[r * FR + c] = c

uint sg_index() { return gl_LocalInvocationIndex / SG; }
uint lane_row() { return (gl_LocalInvocationIndex % SG) / LPR; }
uint lane_part() { return gl_LocalInvocationIndex % LPR; }

// within a subgroup: what its lanes wrote to shared memory is visible to all of them
void subgroup_sync() {
    subgroupMemoryBarrierShared();
    subgroupBarrier();
}

// the sum and the max over the LPR lanes that share a row
float row_sum(float x) {
    [[unroll]] for (uint o = 1u; o < LPR; o *= 2u) x += subgroupShuffleXor(x, o);
    return x;
}
float row_max(float x) {
    [[unroll]] for (uint o = 1u; o < LPR; o *= 2u) x = max(x, subgroupShuffleXor(x, o));
    return x;
}

void fill_ids() {
    for (uint e = gl_LocalInvocationIndex; e < FR * FR; e += NT) {
        RowIds[e] = float(e / FR);
        ColIds[e] = float(e % FR);
    }
}

// an id fragment (fill_ids done and a barrier passed)
#define LOAD_IDS(frag, ids) coopMatLoad(frag, ids, 0u, FR, ROWS)

#ifdef SCORE_ROWS   // the kernels whose lanes read score rows (forward, dq)
shared float Ss[NSG * FR * SROW];       // each subgroup's scores

// s[x] <- this lane's scores of its query row in the key tile from j0, read
// from Ss, scaled and masked; returns their max over the whole row
float row_scores(uint j0, uint b, uint h, uint row, out float s[PER_LANE]) {
    uint at = (sg_index() * FR + lane_row()) * SROW;
    float tmax = NEG_INF;
    [[unroll]] for (uint x = 0u; x < PER_LANE; ++x) {
        uint c = lane_part() + LPR * x;
        s[x] = masked(Ss[at + c] * p.scale, b, h, row, j0 + c);
        tmax = max(tmax, s[x]);
    }
    return row_max(tmax);
}

// One key tile of the online softmax: s <- the row's scores (row_scores),
// m <- the running max with them, and l (this lane's share of the row's
// sum) rescaled to it by corr; returns the shift the tile's exponentials take
float online_step(uint j0, uint b, uint h, uint row, inout float m, inout float l,
                  out float s[PER_LANE], out float corr) {
    float mnew = max(m, row_scores(j0, b, h, row, s));
    // while every score so far is -inf, shift by 0 so exp() gives 0, not NaN
    float mref = mnew == NEG_INF ? 0.0 : mnew;
    corr = exp(m - mref);
    l *= corr;
    m = mnew;
    return mref;
}
#endif

#define VEC8 (p.d % 8u == 0u && p.dh % 8u == 0u)

// x <- src[at + t] for t < 8 as halves packed in a vector, zero from column c + t == dh on
#ifdef BF16
// (the bits of each: a bf16 read and stored again is itself)
#define PACK8(x, src, at, c)                                                         \
    {                                                                                 \
        uint w_[8];                                                                   \
        [[unroll]] for (uint t_ = 0u; t_ < 8u; ++t_)                                  \
            w_[t_] = (c) + t_ < p.dh ? fg_bf16(LOAD(src[(at) + t_])) : 0u;            \
        x = uvec4(w_[0] | (w_[1] << 16), w_[2] | (w_[3] << 16), w_[4] | (w_[5] << 16), w_[6] | (w_[7] << 16)); \
    }
#else
#define PACK8(x, src, at, c)                                                         \
    {                                                                                 \
        float16_t h_[8];                                                              \
        [[unroll]] for (uint t_ = 0u; t_ < 8u; ++t_)                                  \
            h_[t_] = (c) + t_ < p.dh ? src[(at) + t_] : float16_t(0.0);               \
        x = uvec4(packFloat2x16(f16vec2(h_[0], h_[1])), packFloat2x16(f16vec2(h_[2], h_[3])), \
                  packFloat2x16(f16vec2(h_[4], h_[5])), packFloat2x16(f16vec2(h_[6], h_[7]))); \
    }
#endif

// x <- head h's columns c .. c+7 of row r of src as halves, 8 columns per
// vector, zero past seq and past dh
#define HEAD_VEC8(x, src, src8, seq, r, c, b, h)                                    \
    x = uvec4(0u);                                                                    \
    if ((r) < (seq) && (c) < p.dh) {                                                  \
        uint at_ = row_base(b, seq, r, h) + (c);                                      \
        if (VEC8) {                                                                   \
            x = src8[at_ / 8u];                                                       \
        } else {                                                                      \
            PACK8(x, src, at_, c)                                                     \
        }                                                                             \
    }

// dst[off + r * HROW + c / 8] (r < nrows, c < MAXD) <- head h's row r0 + r
// of src as halves (HEAD_VEC8). Every invocation of the workgroup takes part.
#define STAGE(dst, off, src, src8, seq, r0, nrows, b, h)                             \
    for (uint e_ = gl_LocalInvocationIndex; e_ < (nrows) * (MAXD / 8u); e_ += NT) {  \
        uint r_ = e_ / (MAXD / 8u), c_ = (e_ % (MAXD / 8u)) * 8u;                      \
        uvec4 x_;                                                                     \
        HEAD_VEC8(x_, src, src8, seq, (r0) + r_, c_, b, h);                           \
        dst[(off) + r_ * HROW + c_ / 8u] = x_;                                        \
    }

// fa and fb <- A fragments of this subgroup's rows of src_a and src_b
// (rows r0 .. r0+BR-1 of the workgroup), staged one after the other in tile
#define OWN_ROWS(fa, src_a, src_a8, fb, src_b, src_b8, tile, seq, r0, b, h)       \
    STAGE(tile, 0u, src_a, src_a8, seq, r0, BR, b, h);                             \
    barrier();                                                                    \
    LOAD_ROWS_A(fa, tile, 0u, sg_index() * FR);                                    \
    barrier();                                                                    \
    STAGE(tile, 0u, src_b, src_b8, seq, r0, BR, b, h);                             \
    barrier();                                                                    \
    LOAD_ROWS_A(fb, tile, 0u, sg_index() * FR)

// frags[base + d] <- the A fragments of rows row0 .. row0+FR-1 of a staged tile
#define LOAD_ROWS_A_AT(frags, base, tile, off, row0)                                 \
    [[unroll]] for (uint d_ = 0u; d_ < ND; ++d_)                                      \
        coopMatLoad(frags[(base) + d_], tile, (off) + (row0) * HROW + d_ * (FR / 8u), HROW, ROWS)
#define LOAD_ROWS_A(frags, tile, off, row0) LOAD_ROWS_A_AT(frags, 0u, tile, off, row0)

// s[n] <- A(FR x MAXD, fragments a) times the transpose of streamed rows
// n*FR .. n*FR+FR-1 of a staged tile, stored to this subgroup's score rows
#define SCORES(dst, a, tile, off)                                                    \
    [[unroll]] for (uint n_ = 0u; n_ < NB; ++n_) {                                   \
        FRAG_C s_ = FRAG_C(0.0);                                                      \
        [[unroll]] for (uint d_ = 0u; d_ < ND; ++d_) {                                \
            FRAG_B t_;                                                                \
            coopMatLoad(t_, tile, (off) + n_ * FR * HROW + d_ * (FR / 8u), HROW, COLS); \
            s_ = coopMatMulAdd(a[d_], t_, s_);                                        \
        }                                                                             \
        coopMatStore(s_, dst, sg_index() * FR * SROW + n_ * FR, SROW, ROWS);          \
    }

// s <- A (FR x MAXD, fragments a) times the transpose of streamed rows
// n*FR .. n*FR+FR-1 of a staged tile, kept in the accumulator
#define SCORE_FRAG(s, a, tile, off, n)                                               \
    s = FRAG_C(0.0);                                                                  \
    [[unroll]] for (uint d_ = 0u; d_ < ND; ++d_) {                                    \
        FRAG_B t_;                                                                    \
        coopMatLoad(t_, tile, (off) + (n) * FR * HROW + d_ * (FR / 8u), HROW, COLS);  \
        s = coopMatMulAdd(a[d_], t_, s);                                              \
    }

// an accumulator fragment, as HT, to columns n*FR .. of this subgroup's rows of dst
#define STORE_F16(frag, dst, n)                                                      \
    coopMatStore(coopmat<HT, gl_ScopeSubgroup, FR, FR, gl_MatrixUseAccumulator>(frag), \
                 dst, sg_index() * FR * PROW + (n) * FR, PROW, ROWS)

// acc[d] += P (this subgroup's FR x BC HT rows of src) times the streamed
// tile's rows (BC x MAXD)
#define ACCUMULATE(acc, src, tile, off)                                              \
    [[unroll]] for (uint n_ = 0u; n_ < NB; ++n_) {                                   \
        FRAG_A p_;                                                                    \
        coopMatLoad(p_, src, sg_index() * FR * PROW + n_ * FR, PROW, ROWS);           \
        [[unroll]] for (uint d_ = 0u; d_ < ND; ++d_) {                                \
            FRAG_B t_;                                                                \
            coopMatLoad(t_, tile, (off) + n_ * FR * HROW + d_ * (FR / 8u), HROW, ROWS); \
            acc[d_] = coopMatMulAdd(p_, t_, acc[d_]);                                 \
        }                                                                             \
    }

// head h's columns of rows row0 + r (r < FR, below seq) of dst <- acc[base + d] * factor,
// rounded to HT once, each fragment through this subgroup's HT rows of stage
// (after its lanes' last reads of them); a staged HT as T (bf16: the same value)
#ifdef BF16
#define STAGED(x) STORE(float(x))
#else
#define STAGED(x) x
#endif
#define STORE_ROWS_AT(dst, acc, base, factor, stage, seq, row0, b, h)                 \
    subgroup_sync();                                                                  \
    [[unroll]] for (uint d_ = 0u; d_ < ND; ++d_) {                                    \
        STORE_F16(acc[(base) + d_] * (factor), stage, 0u);                            \
        subgroup_sync();                                                              \
        uint r_ = lane_row(), row_ = (row0) + r_;                                     \
        for (uint c_ = lane_part(); c_ < FR; c_ += LPR) {                             \
            uint col_ = d_ * FR + c_;                                                 \
            if (row_ < (seq) && col_ < p.dh)                                          \
                dst[row_base(b, seq, row_, h) + col_] = STAGED(stage[(sg_index() * FR + r_) * PROW + c_]); \
        }                                                                             \
        subgroup_sync();                                                              \
    }
#define STORE_ROWS(dst, acc, factor, stage, seq, row0, b, h) STORE_ROWS_AT(dst, acc, 0u, factor, stage, seq, row0, b, h)

#ifdef CM2
// VK_NV_cooperative_matrix2 on subgroup-scope fragments (the attn_cm2_*
// builds): row reductions and conversions between uses, so what the softmax
// makes (probabilities, dS) becomes an A fragment without a round trip
// through shared memory.

// the attn_cm2 kernels exponentiate in base 2: scores and statistics scaled by log2(e)
#define LOG2E 1.4426950408889634

float max_of(const in float a, const in float b) { return max(a, b); }
float sum_of(const in float a, const in float b) { return a + b; }

// acc[d] += the accumulator fragment pf (this subgroup's rows by streamed
// rows n*FR .. n*FR+FR-1), rounded to an HT A fragment, times those streamed
// rows of a staged tile (FR x MAXD)
#define ACCUMULATE_FRAG(acc, pf, tile, off, n)                                       \
    {                                                                                 \
        FRAG_A p_ = FRAG_A(pf);                                                       \
        [[unroll]] for (uint d_ = 0u; d_ < ND; ++d_) {                                \
            FRAG_B t_;                                                                \
            coopMatLoad(t_, tile, (off) + (n) * FR * HROW + d_ * (FR / 8u), HROW, ROWS); \
            acc[d_] = coopMatMulAdd(p_, t_, acc[d_]);                                 \
        }                                                                             \
    }

// A streamed tile in flight: regs[l] holds what STAGE would store for element
// e = invocation + l * NT of head h's rows r0 .. r0+BC-1. Fetched into
// registers before a tile's products, stored to shared memory after them
// (PUT_TILE), so the global loads' latency overlaps the products.
#define FETCH_N ((BC * (MAXD / 8u) + NT - 1u) / NT)
#define FETCH_TILE(regs, src, src8, seq, r0, b, h)                                   \
    [[unroll]] for (uint l_ = 0u; l_ < FETCH_N; ++l_) {                              \
        uint e_ = gl_LocalInvocationIndex + l_ * NT;                                  \
        uint r_ = e_ / (MAXD / 8u), c_ = (e_ % (MAXD / 8u)) * 8u;                      \
        HEAD_VEC8(regs[l_], src, src8, seq, e_ < BC * (MAXD / 8u) ? (r0) + r_ : (seq), c_, b, h); \
    }
#define PUT_TILE(dst, off, regs)                                                     \
    [[unroll]] for (uint l_ = 0u; l_ < FETCH_N; ++l_) {                              \
        uint e_ = gl_LocalInvocationIndex + l_ * NT;                                  \
        if (e_ < BC * (MAXD / 8u)) dst[(off) + (e_ / (MAXD / 8u)) * HROW + e_ % (MAXD / 8u)] = regs[l_]; \
    }
#endif
