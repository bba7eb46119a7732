// compiler: glslc-2025 (GL_NV_cooperative_matrix2 needs glslang 15 or newer)
#version 450
// Flash-attention forward on cooperative matrices with VK_NV_cooperative_matrix2's
// row reductions and use conversions (the staging is attn_coop.glsl's; the
// algorithm attn_fwd.glsl's): the scores, the probabilities and the softmax's
// running statistics stay in the subgroup's fragments. A subgroup owns RF row
// fragments (RF * FR query rows), so each K or V fragment it loads feeds RF
// products. Per key tile, S = Q K^T on accumulator fragments, scaled into
// log2 units (exp2 then needs no multiply); only a tile that crosses the
// diagonal, a sequence's end or a mask masks its elements, by their row and
// column (the id fragments, loaded there); the tile's row max is one row
// reduction of the elementwise max of its fragments, and P = 2^(S - m) turns
// into A fragments for O += P V in place. The running max m and this tile's
// correction are kept smeared along the rows (every element of a row holds the
// row's value), so they scale O, l and P as whole fragments; l is kept as
// partial sums per element and reduced once, at the end. The next key tile's
// K and V rows are fetched into registers while this one's products run.
// Elements are indexed only on single fragments, never through an array of
// them: with s[n][e] and acc[d][e] in the element loops NVIDIA's driver gave
// this kernel 256 bytes of local memory per invocation (160 without) and it
// ran 1.6x as long.
#ifndef CM2
#error "attn_cm2_fwd is built with CM2 (VK_NV_cooperative_matrix2)"
#endif
#ifndef RF
#define RF 1
#endif
#define PROW (FR + 8)          // a row of the output's f16 staging, in halves
#include "attn_coop.glsl"

#define WR (NSG * RF * FR)     // the workgroup's query rows
#define QCHUNK (2 * BC)        // query rows staged at a time through KVs

layout(std430, set = 0, binding = 4) writeonly buffer O { T o[]; };
layout(std430, set = 0, binding = 5) writeonly buffer Stats { float stats[]; };

shared uvec4 KVs[2 * BC * HROW];        // K at 0, V at BC * HROW (Q staged here first)
shared HT Os[NSG * FR * PROW];   // each subgroup's output rows on their way out

void main() {
    uint sg = sg_index();
    uvec3 tile = own_tile(true);
    uint h = tile.y, b = tile.z;
    uint i0 = tile.x * WR, r0 = i0 + sg * RF * FR;   // the workgroup's and this subgroup's first query row
    uint jend = p.causal != 0u ? min(p.sk, i0 + WR) : p.sk;
    float scale2 = p.scale * LOG2E;

    fill_ids();
    uvec4 kr[FETCH_N], vr[FETCH_N];
    FETCH_TILE(kr, k, k8, p.sk, 0u, b, h);
    FETCH_TILE(vr, v, v8, p.sk, 0u, b, h);
    FRAG_A qf[RF * ND];
    for (uint c0 = 0u; c0 < WR; c0 += QCHUNK) {
        if (c0 > 0u) barrier();   // the previous chunk's fragments are loaded
        STAGE(KVs, 0u, q, q8, p.sq, i0 + c0, min(uint(QCHUNK), uint(WR) - c0), b, h);
        barrier();
        [[unroll]] for (uint f = 0u; f < RF; ++f) {
            uint at = (sg * RF + f) * FR;
            if (at >= c0 && at < c0 + QCHUNK)
                LOAD_ROWS_A_AT(qf, f * ND, KVs, 0u, at - c0);
        }
    }
    FRAG_C acc[RF * ND], m[RF], l[RF];
    [[unroll]] for (uint x = 0u; x < RF * ND; ++x) acc[x] = FRAG_C(0.0);
    [[unroll]] for (uint f = 0u; f < RF; ++f) {
        m[f] = FRAG_C(NEG_INF);
        l[f] = FRAG_C(0.0);
    }

    for (uint j0 = 0u; j0 < jend; j0 += BC) {
        barrier();   // Q's fragments are loaded, the previous tile is no longer read
        PUT_TILE(KVs, 0u, kr);
        PUT_TILE(KVs, BC * HROW, vr);
        barrier();
        if (j0 + BC < jend) {
            FETCH_TILE(kr, k, k8, p.sk, j0 + BC, b, h);
            FETCH_TILE(vr, v, v8, p.sk, j0 + BC, b, h);
        }
        FRAG_C s[RF * NB];
        [[unroll]] for (uint n = 0u; n < NB; ++n) {
            [[unroll]] for (uint f = 0u; f < RF; ++f) s[f * NB + n] = FRAG_C(0.0);
            [[unroll]] for (uint d = 0u; d < ND; ++d) {
                FRAG_B t;
                coopMatLoad(t, KVs, n * FR * HROW + d * (FR / 8u), HROW, COLS);
                [[unroll]] for (uint f = 0u; f < RF; ++f) s[f * NB + n] = coopMatMulAdd(qf[f * ND + d], t, s[f * NB + n]);
            }
        }
        [[unroll]] for (uint f = 0u; f < RF; ++f) {
            uint rf0 = r0 + f * FR;
            bool edge = p.mask_mode != 0u || j0 + BC > p.sk || (p.causal != 0u && j0 + BC > rf0 + 1u);
            FRAG_C top = FRAG_C(NEG_INF);
            if (edge) {
                FRAG_C rid, cid;
                LOAD_IDS(rid, RowIds);
                LOAD_IDS(cid, ColIds);
                [[unroll]] for (uint n = 0u; n < NB; ++n) {
                    FRAG_C x = s[f * NB + n];
                    [[unroll]] for (uint e = 0u; e < uint(x.length()); ++e) {
                        x[e] = LOG2E * masked(x[e] * p.scale, b, h, rf0 + uint(rid[e]), j0 + n * FR + uint(cid[e]));
                        top[e] = max(top[e], x[e]);
                    }
                    s[f * NB + n] = x;
                }
            } else {
                [[unroll]] for (uint n = 0u; n < NB; ++n) {
                    FRAG_C x = s[f * NB + n] * scale2;
                    [[unroll]] for (uint e = 0u; e < uint(x.length()); ++e) top[e] = max(top[e], x[e]);
                    s[f * NB + n] = x;
                }
            }
            FRAG_C mtile, mold = m[f], mnew, shift, corr;
            coopMatReduceNV(mtile, top, gl_CooperativeMatrixReduceRowNV, max_of);
            [[unroll]] for (uint e = 0u; e < uint(mnew.length()); ++e) {
                mnew[e] = max(mold[e], mtile[e]);
                // while every score so far is -inf, shift by 0 so exp2() gives 0, not NaN
                shift[e] = mnew[e] == NEG_INF ? 0.0 : mnew[e];
                corr[e] = exp2(mold[e] - shift[e]);
            }
            m[f] = mnew;
            FRAG_C lf = l[f] * corr;
            [[unroll]] for (uint d = 0u; d < ND; ++d) acc[f * ND + d] = acc[f * ND + d] * corr;
            [[unroll]] for (uint n = 0u; n < NB; ++n) {
                FRAG_C x = s[f * NB + n];
                [[unroll]] for (uint e = 0u; e < uint(x.length()); ++e) x[e] = exp2(x[e] - shift[e]);
                lf += x;
                s[f * NB + n] = x;
            }
            l[f] = lf;
        }
        [[unroll]] for (uint n = 0u; n < NB; ++n) {
            FRAG_A pa[RF];
            [[unroll]] for (uint f = 0u; f < RF; ++f) pa[f] = FRAG_A(s[f * NB + n]);
            [[unroll]] for (uint d = 0u; d < ND; ++d) {
                FRAG_B t;
                coopMatLoad(t, KVs, BC * HROW + n * FR * HROW + d * (FR / 8u), HROW, ROWS);
                [[unroll]] for (uint f = 0u; f < RF; ++f) acc[f * ND + d] = coopMatMulAdd(pa[f], t, acc[f * ND + d]);
            }
        }
    }

    FRAG_C rid, cid;
    LOAD_IDS(rid, RowIds);
    LOAD_IDS(cid, ColIds);
    [[unroll]] for (uint f = 0u; f < RF; ++f) {
        FRAG_C lsum, mf = m[f], inv;
        coopMatReduceNV(lsum, l[f], gl_CooperativeMatrixReduceRowNV, sum_of);
        [[unroll]] for (uint e = 0u; e < uint(lsum.length()); ++e) {
            float ls = lsum[e];
            uint row = r0 + f * FR + uint(rid[e]);
            if (uint(cid[e]) == 0u && row < p.sq) {   // one element per row saves the row's statistics
                stats[stat_index(b, h, row)] = ls > 0.0 ? mf[e] * (1.0 / LOG2E) : POS_INF;
                stats[p.nstat + stat_index(b, h, row)] = ls > 0.0 ? log(ls) : 0.0;
            }
            inv[e] = ls > 0.0 ? 1.0 / ls : 0.0;   // a fully masked row gives 0
        }
        [[unroll]] for (uint d = 0u; d < ND; ++d) acc[f * ND + d] = acc[f * ND + d] * inv;
        STORE_ROWS_AT(o, acc, f * ND, 1.0, Os, p.sq, r0 + f * FR, b, h);
    }
}
