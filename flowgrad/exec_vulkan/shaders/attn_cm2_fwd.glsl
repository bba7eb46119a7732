// compiler: glslc-2025 (GL_NV_cooperative_matrix2 needs glslang 15 or newer)
#version 450
// Flash-attention forward on cooperative matrices with VK_NV_cooperative_matrix2's
// row reductions and use conversions (the tiling and the staging are
// attn_coop.glsl's; the algorithm attn_fwd.glsl's): the scores, the
// probabilities and the softmax's running statistics stay in the subgroup's
// fragments. Per key tile, S = Q K^T on accumulator fragments; where the tile
// crosses the diagonal, a sequence's end or a mask, each element is masked by
// its row and column (the id fragments); the tile's row max is one row
// reduction of the elementwise max of its fragments, and P = exp(S - m) turns
// into A fragments for O += P V in place. The running max m and this tile's
// correction are kept smeared along the rows (every element of a row holds the
// row's value), so they scale O and P element by element; l is kept as partial
// sums per element and reduced once, at the end. The next key tile's K and V
// rows are fetched into registers while this one's products run.
#ifndef CM2
#error "attn_cm2_fwd is built with CM2 (VK_NV_cooperative_matrix2)"
#endif
#define PROW (FR + 8)          // a row of the output's f16 staging, in halves
#include "attn_coop.glsl"

layout(std430, set = 0, binding = 4) writeonly buffer O { T o[]; };
layout(std430, set = 0, binding = 5) writeonly buffer Stats { float stats[]; };

shared uvec4 KVs[2 * BC * HROW];        // K at 0, V at BC * HROW (Q staged here first)
shared float16_t Os[NSG * FR * PROW];   // each subgroup's output rows on their way out

void main() {
    uint sg = sg_index();
    uvec3 tile = own_tile(true);
    uint h = tile.y, b = tile.z;
    uint i0 = tile.x * BR, r0 = i0 + sg * FR;   // the workgroup's and this subgroup's first query row
    uint jend = p.causal != 0u ? min(p.sk, i0 + BR) : p.sk;

    fill_ids();
    STAGE(KVs, 0u, q, q8, p.sq, i0, BR, b, h);
    uvec4 kr[FETCH_N], vr[FETCH_N];
    FETCH_TILE(kr, k, k8, p.sk, 0u, b, h);
    FETCH_TILE(vr, v, v8, p.sk, 0u, b, h);
    barrier();
    FRAG_C rid, cid;
    LOAD_IDS(rid, RowIds);
    LOAD_IDS(cid, ColIds);
    FRAG_A qf[ND];
    LOAD_ROWS_A(qf, KVs, 0u, sg * FR);
    FRAG_C acc[ND];
    [[unroll]] for (uint d = 0u; d < ND; ++d) acc[d] = FRAG_C(0.0);
    FRAG_C m = FRAG_C(NEG_INF), l = FRAG_C(0.0);

    for (uint j0 = 0u; j0 < jend; j0 += BC) {
        barrier();   // Q's fragments are loaded, the previous tile is no longer read
        PUT_TILE(KVs, 0u, kr);
        PUT_TILE(KVs, BC * HROW, vr);
        barrier();
        if (j0 + BC < jend) {
            FETCH_TILE(kr, k, k8, p.sk, j0 + BC, b, h);
            FETCH_TILE(vr, v, v8, p.sk, j0 + BC, b, h);
        }
        bool edge = p.mask_mode != 0u || j0 + BC > p.sk || (p.causal != 0u && j0 + BC > r0 + 1u);
        FRAG_C s[NB], top = FRAG_C(NEG_INF);
        [[unroll]] for (uint n = 0u; n < NB; ++n) {
            SCORE_FRAG(s[n], qf, KVs, 0u, n);
            for (uint e = 0u; e < uint(top.length()); ++e) {
                float x = s[n][e] * p.scale;
                if (edge) x = masked(x, b, h, r0 + uint(rid[e]), j0 + n * FR + uint(cid[e]));
                s[n][e] = x;
                top[e] = max(top[e], x);
            }
        }
        FRAG_C mtile, shift;
        coopMatReduceNV(mtile, top, gl_CooperativeMatrixReduceRowNV, max_of);
        for (uint e = 0u; e < uint(m.length()); ++e) {
            float mnew = max(m[e], mtile[e]);
            // while every score so far is -inf, shift by 0 so exp() gives 0, not NaN
            float mref = mnew == NEG_INF ? 0.0 : mnew, corr = exp(m[e] - mref);
            m[e] = mnew;
            shift[e] = mref;
            l[e] *= corr;
            [[unroll]] for (uint d = 0u; d < ND; ++d) acc[d][e] *= corr;
        }
        [[unroll]] for (uint n = 0u; n < NB; ++n) {
            for (uint e = 0u; e < uint(l.length()); ++e) {
                float pv = exp(s[n][e] - shift[e]);
                s[n][e] = pv;
                l[e] += pv;
            }
            ACCUMULATE_FRAG(acc, s[n], KVs, BC * HROW, n);
        }
    }

    FRAG_C lsum;
    coopMatReduceNV(lsum, l, gl_CooperativeMatrixReduceRowNV, sum_of);
    for (uint e = 0u; e < uint(lsum.length()); ++e) {
        float ls = lsum[e];
        uint row = r0 + uint(rid[e]);
        if (uint(cid[e]) == 0u && row < p.sq) {   // one element per row saves the row's statistics
            stats[stat_index(b, h, row)] = ls > 0.0 ? m[e] : POS_INF;
            stats[p.nstat + stat_index(b, h, row)] = ls > 0.0 ? log(ls) : 0.0;
        }
        float inv = ls > 0.0 ? 1.0 / ls : 0.0;   // a fully masked row gives 0
        [[unroll]] for (uint d = 0u; d < ND; ++d) acc[d][e] *= inv;
    }
    STORE_ROWS(o, acc, 1.0, Os, p.sq, r0, b, h);
}
