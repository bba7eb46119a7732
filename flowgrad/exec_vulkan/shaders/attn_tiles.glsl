// The scalar attention kernels' tiling (attn_fwd, attn_bwd_dq, attn_bwd_dkdv).
// The tile defines come from the build table in attention_builds.py, which
// scripts/build_shaders.py compiles once per entry:
//   MAXD      head-width bound (zero padding past dh adds nothing to a dot)
//   BR        own rows per workgroup (queries; keys in the dk/dv pass)
//   BC        streamed rows per shared tile
//   CT        threads per row group; a row group owns RQ = 4 rows
//   KV_SLOTS  (forward, dq) 2: the K and V tiles side by side; 1: one after
//             the other in one slot, where two would not fit shared memory
// Thread t is column thread c = t % CT of row group rg = t / CT:
// it owns rows rg*4 .. rg*4+3, streamed rows c + CT*x, and head columns
// (vec4 chunks) c + CT*y. Shared tiles are vec4 rows padded by one vec4, so
// the CT threads reading different rows hit different banks.
#include "attn_common.glsl"

#define RQ 4
#define NC (MAXD / 4)
#define PAD (NC + 1)
#define KPT (BC / CT)
#define CPT (NC / CT)
#define RG (BR / RQ)
#define NT (RG * CT)

layout(local_size_x = NT) in;

// dst[r * PAD + ch] (r < nrows) <- head h's row r0 + r of src as vec4 chunks,
// zero past seq and past dh. All threads of the workgroup take part.
#define LOAD_TILE(dst, off, src, seq, r0, nrows, b, h)                               \
    for (uint e_ = gl_LocalInvocationID.x; e_ < (nrows) * NC; e_ += NT) {             \
        uint r_ = e_ / NC, ch_ = e_ % NC;                                            \
        vec4 x_ = vec4(0.0);                                                          \
        if ((r0) + r_ < (seq)) {                                                      \
            uint base_ = row_base(b, seq, (r0) + r_, h) + 4u * ch_;                   \
            for (uint t_ = 0u; t_ < 4u; ++t_)                                         \
                if (4u * ch_ + t_ < p.dh) x_[t_] = LOAD(src[base_ + t_]);             \
        }                                                                             \
        dst[(off) + r_ * PAD + ch_] = x_;                                             \
    }

// A streamed tile in flight: regs[l] holds element e = t + l * NT (row e / NC,
// chunk e % NC) of head h's rows r0 .. r0 + BC - 1, zero past seq and dh.
// Fetched into registers before a tile's arithmetic, stored to shared
// memory after it (PUT_TILE, with the same rows), so the global loads'
// latency overlaps the arithmetic. Where that would take more than 16 vec4
// registers per array (wide heads over few threads) they would spill, so
// PUT_TILE loads straight into shared memory instead and FETCH_TILE is empty.
#define FETCH_N ((BC * NC + NT - 1) / NT)
#if FETCH_N <= 16
#define FETCH_REGS FETCH_N
#define FETCH_TILE(regs, src, seq, r0, b, h)                                         \
    [[unroll]] for (uint l_ = 0u; l_ < FETCH_N; ++l_) {                              \
        uint e_ = gl_LocalInvocationID.x + l_ * NT, r_ = e_ / NC, ch_ = e_ % NC;     \
        vec4 x_ = vec4(0.0);                                                          \
        if (e_ < BC * NC && (r0) + r_ < (seq)) {                                      \
            uint base_ = row_base(b, seq, (r0) + r_, h) + 4u * ch_;                   \
            [[unroll]] for (uint t_ = 0u; t_ < 4u; ++t_)                              \
                if (4u * ch_ + t_ < p.dh) x_[t_] = LOAD(src[base_ + t_]);             \
        }                                                                             \
        regs[l_] = x_;                                                                \
    }
#define PUT_TILE(dst, off, regs, src, seq, r0, b, h)                                 \
    [[unroll]] for (uint l_ = 0u; l_ < FETCH_N; ++l_) {                              \
        uint e_ = gl_LocalInvocationID.x + l_ * NT;                                   \
        if (e_ < BC * NC) dst[(off) + (e_ / NC) * PAD + e_ % NC] = regs[l_];         \
    }
#else
#define FETCH_REGS 1
#define FETCH_TILE(regs, src, seq, r0, b, h)
#define PUT_TILE(dst, off, regs, src, seq, r0, b, h) LOAD_TILE(dst, off, src, seq, r0, BC, b, h)
#endif

// out[a][x] = dot of shared head rows A[ia0 + a] and B[ib0 + ibs * x] over
// the live chunks, for every a < RQ and x < KPT at once: RQ * KPT
// independent sums (one dependent chain each would leave the SM waiting on
// FMA latency), each loaded chunk used KPT or RQ times. nc is uniform.
#define TILE_DOTS(out, A, ia0, B, ib0, ibs, nc)                                     \
    [[unroll]] for (uint a_ = 0u; a_ < RQ; ++a_)                                     \
        [[unroll]] for (uint x_ = 0u; x_ < KPT; ++x_) out[a_][x_] = 0.0;             \
    for (uint ch_ = 0u; ch_ < NC; ++ch_) {                                           \
        if (ch_ >= (nc)) break;                                                      \
        vec4 b_[KPT];                                                                \
        [[unroll]] for (uint x_ = 0u; x_ < KPT; ++x_) b_[x_] = B[((ib0) + (ibs) * x_) * PAD + ch_]; \
        [[unroll]] for (uint a_ = 0u; a_ < RQ; ++a_) {                               \
            vec4 av_ = A[((ia0) + a_) * PAD + ch_];                                  \
            [[unroll]] for (uint x_ = 0u; x_ < KPT; ++x_) out[a_][x_] += dot(av_, b_[x_]); \
        }                                                                            \
    }

// TILE_DOTS of (A1, B1) into out1 and of (A2, B2) into out2 in one sweep
#define TILE_DOTS2(out1, A1, B1, out2, A2, B2, ia0, ib0, ibs, nc)                   \
    [[unroll]] for (uint a_ = 0u; a_ < RQ; ++a_)                                     \
        [[unroll]] for (uint x_ = 0u; x_ < KPT; ++x_) { out1[a_][x_] = 0.0; out2[a_][x_] = 0.0; } \
    for (uint ch_ = 0u; ch_ < NC; ++ch_) {                                           \
        if (ch_ >= (nc)) break;                                                      \
        vec4 b1_[KPT], b2_[KPT];                                                     \
        [[unroll]] for (uint x_ = 0u; x_ < KPT; ++x_) {                              \
            b1_[x_] = B1[((ib0) + (ibs) * x_) * PAD + ch_];                          \
            b2_[x_] = B2[((ib0) + (ibs) * x_) * PAD + ch_];                          \
        }                                                                            \
        [[unroll]] for (uint a_ = 0u; a_ < RQ; ++a_) {                               \
            vec4 a1_ = A1[((ia0) + a_) * PAD + ch_], a2_ = A2[((ia0) + a_) * PAD + ch_]; \
            [[unroll]] for (uint x_ = 0u; x_ < KPT; ++x_) {                          \
                out1[a_][x_] += dot(a1_, b1_[x_]);                                   \
                out2[a_][x_] += dot(a2_, b2_[x_]);                                   \
            }                                                                        \
        }                                                                            \
    }
