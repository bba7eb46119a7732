// compiler: glslc-2025 (GL_KHR_cooperative_matrix needs glslang 14 or newer)
#version 450
// Flash-attention backward, pass 1 of 2, on cooperative matrices (see
// attn_coop.glsl and, for the algorithm, attn_bwd_dq.glsl): a workgroup owns
// BR query rows. Per key tile, S = Q K^T and dP = G V^T on fragments, and
// dS = P (dP - D) with P = exp(S - m - log l) on their elements, stored as f16 and
// read back as A fragments for dQ += dS K; each row's m, log l and D come from
// attn_bwd_stats. The attn_cm2 build (CM2) turns dS into A fragments in place
// (VK_NV_cooperative_matrix2's conversions), fetches the next K and V rows
// into registers while a tile's products run, keeps each row's statistics in
// fragments smeared along the rows, exponentiates in base 2 and masks only the
// tiles that need it.
#ifdef CM2
#define PROW (FR + 8)          // Ps only stages the output rows
#endif
#include "attn_coop.glsl"

layout(std430, set = 0, binding = 4) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 4) readonly buffer G8 { uvec4 g8[]; };
layout(std430, set = 0, binding = 5) readonly buffer Stats { float stats[]; };  // m, log l, D
layout(std430, set = 0, binding = 6) writeonly buffer DQ { T dq[]; };

shared uvec4 KVs[2 * BC * HROW];        // K at 0, V at BC * HROW (Q, then G, staged here first)
shared HT Ps[NSG * FR * PROW];   // each subgroup's dS (CM2: its output rows on their way out)
shared float Mrow[BR], LLrow[BR], Drow[BR];  // the own rows' m, log l and D

void main() {
    uint sg = sg_index(), r = lane_row(), part = lane_part();
    uvec3 tile = own_tile(true);
    uint h = tile.y, b = tile.z;
    uint i0 = tile.x * BR, row = i0 + sg * FR + r;

    fill_ids();
    FRAG_A qf[ND], gf[ND];
    OWN_ROWS(qf, q, q8, gf, g, g8, KVs, p.sq, i0, b, h);

    uint jend = p.causal != 0u ? min(p.sk, i0 + BR) : p.sk;
#ifdef CM2
    uvec4 kr[FETCH_N], vr[FETCH_N];
    FETCH_TILE(kr, k, k8, p.sk, 0u, b, h);
    FETCH_TILE(vr, v, v8, p.sk, 0u, b, h);
#endif
    if (part == 0u) {
        uint si = stat_index(b, h, row);
        Mrow[sg * FR + r] = row < p.sq ? stats[si] : POS_INF;
        LLrow[sg * FR + r] = row < p.sq ? stats[p.nstat + si] : 0.0;
        Drow[sg * FR + r] = row < p.sq ? stats[2u * p.nstat + si] : 0.0;
    }
    barrier();   // the ids and the rows' statistics are visible
#ifdef CM2
    // each row's m and log l (in log2 units) and D, smeared along the fragment's rows
    FRAG_C m2, ll2, drow;
    {
        FRAG_C rid;
        LOAD_IDS(rid, RowIds);
        [[unroll]] for (uint e = 0u; e < uint(rid.length()); ++e) {
            uint own = sg * FR + uint(rid[e]);
            m2[e] = Mrow[own] * LOG2E;
            ll2[e] = LLrow[own] * LOG2E;
            drow[e] = Drow[own];
        }
    }
    float scale2 = p.scale * LOG2E;
#else
    FRAG_C rid, cid;
    LOAD_IDS(rid, RowIds);
    LOAD_IDS(cid, ColIds);
#endif

    // dS = P (dP - D) on the fragments' elements, each row's m, log l and D by its row id
    FRAG_C acc[ND];
    [[unroll]] for (uint d = 0u; d < ND; ++d) acc[d] = FRAG_C(0.0);
    for (uint j0 = 0u; j0 < jend; j0 += BC) {
        barrier();
#ifdef CM2
        PUT_TILE(KVs, 0u, kr);
        PUT_TILE(KVs, BC * HROW, vr);
        barrier();
        if (j0 + BC < jend) {
            FETCH_TILE(kr, k, k8, p.sk, j0 + BC, b, h);
            FETCH_TILE(vr, v, v8, p.sk, j0 + BC, b, h);
        }
#else
        STAGE(KVs, 0u, k, k8, p.sk, j0, BC, b, h);
        STAGE(KVs, BC * HROW, v, v8, p.sk, j0, BC, b, h);
        barrier();
#endif
        [[unroll]] for (uint n = 0u; n < NB; ++n) {
            FRAG_C s, dp;
            SCORE_FRAG(s, qf, KVs, 0u, n);
            SCORE_FRAG(dp, gf, KVs, BC * HROW, n);
#ifdef CM2
            // only a tile that crosses the diagonal, the keys' end or a mask masks its elements
            if (p.mask_mode != 0u || j0 + BC > p.sk || (p.causal != 0u && j0 + BC > i0 + sg * FR + 1u)) {
                FRAG_C rid, cid;
                LOAD_IDS(rid, RowIds);
                LOAD_IDS(cid, ColIds);
                [[unroll]] for (uint e = 0u; e < uint(s.length()); ++e)
                    s[e] = LOG2E * masked(s[e] * p.scale, b, h, i0 + sg * FR + uint(rid[e]), j0 + n * FR + uint(cid[e]));
            } else {
                s = s * scale2;
            }
            [[unroll]] for (uint e = 0u; e < uint(s.length()); ++e) s[e] = exp2((s[e] - m2[e]) - ll2[e]);
            s = s * (dp - drow);
#else
            [[unroll]] for (uint e = 0u; e < uint(s.length()); ++e) {
                uint own = sg * FR + uint(rid[e]);
                float pij = exp(masked(s[e] * p.scale, b, h, i0 + own, j0 + n * FR + uint(cid[e])) - Mrow[own] - LLrow[own]);
                s[e] = pij * (dp[e] - Drow[own]);
            }
#endif
#ifdef CM2
            ACCUMULATE_FRAG(acc, s, KVs, 0u, n);
#else
            STORE_F16(s, Ps, n);
#endif
        }
#ifndef CM2
        subgroup_sync();
        ACCUMULATE(acc, Ps, KVs, 0u);
#endif
    }

    STORE_ROWS(dq, acc, p.scale, Ps, p.sq, i0 + sg * FR, b, h);
}
