// compiler: glslc-2025 (GL_KHR_cooperative_matrix needs glslang 14 or newer)
#version 450
// Flash-attention backward, pass 1 of 2, on cooperative matrices (see
// attn_coop.glsl and, for the algorithm, attn_bwd_dq.glsl): a workgroup owns
// BR query rows. Per key tile, S = Q K^T and dP = G V^T on fragments, and
// dS = P (dP - D) with P = exp(S - lse) on their elements, stored as f16 and
// read back as A fragments for dQ += dS K. Saves D (and, where it recomputed
// it, lse) for the dk/dv pass.
#define SCORE_ROWS
#include "attn_coop.glsl"

layout(std430, set = 0, binding = 4) readonly buffer O { T o[]; };
layout(std430, set = 0, binding = 5) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 5) readonly buffer G8 { uvec4 g8[]; };
layout(std430, set = 0, binding = 6) writeonly buffer DQ { T dq[]; };
layout(std430, set = 0, binding = 7) buffer Stats { float stats[]; };  // lse then D

shared uvec4 KVs[2 * BC * HROW];        // K at 0, V at BC * HROW (Q, then G, staged here first)
shared float16_t Ps[NSG * FR * PROW];   // each subgroup's dS
shared float Lrow[BR], Drow[BR];        // the own rows' lse and D

// The row's log-sum-exp from a sweep over the key tiles (every invocation
// takes part; the score fragments as the forward makes them).
float recompute_lse(FRAG_A qf[ND], uint b, uint h, uint i0, uint jend, uint row) {
    float m = NEG_INF, l = 0.0;
    for (uint j0 = 0u; j0 < jend; j0 += BC) {
        barrier();
        STAGE(KVs, 0u, k, k8, p.sk, j0, BC, b, h);
        barrier();
        SCORES(Ss, qf, KVs, 0u);
        subgroup_sync();
        float s[PER_LANE], corr;
        float mref = online_step(j0, b, h, row, m, l, s, corr);
        [[unroll]] for (uint x = 0u; x < PER_LANE; ++x) l += exp(s[x] - mref);
        subgroup_sync();   // the scores are read before the next tile's are stored
    }
    l = row_sum(l);
    return l > 0.0 ? m + log(l) : POS_INF;
}

void main() {
    uint sg = sg_index(), r = lane_row(), part = lane_part();
    uint h = gl_WorkGroupID.y, b = gl_WorkGroupID.z;
    uint i0 = gl_WorkGroupID.x * BR, row = i0 + sg * FR + r;

    fill_ids();
    FRAG_A qf[ND], gf[ND];
    OWN_ROWS(qf, q, q8, gf, g, g8, KVs, p.sq, i0, b, h);

    // D_i = g_i . out_i, from the row's lanes
    float dpart = 0.0;
    if (row < p.sq) {
        uint base = row_base(b, p.sq, row, h);
        for (uint c = part; c < p.dh; c += LPR) dpart += LOAD(g[base + c]) * LOAD(o[base + c]);
    }
    float drow = row_sum(dpart);

    uint jend = p.causal != 0u ? min(p.sk, i0 + BR) : p.sk;
    float lse = POS_INF;
    if (p.saved_lse != 0u) {
        if (row < p.sq) lse = stats[stat_index(b, h, row)];
    } else {
        lse = recompute_lse(qf, b, h, i0, jend, row);
    }

    if (part == 0u) {
        Lrow[sg * FR + r] = lse;
        Drow[sg * FR + r] = drow;
    }
    barrier();   // the ids and the rows' statistics are visible
    FRAG_C rid, cid;
    LOAD_IDS(rid, RowIds);
    LOAD_IDS(cid, ColIds);

    // dS = P (dP - D) on the fragments' elements, each row's lse and D by its row id
    FRAG_C acc[ND];
    [[unroll]] for (uint d = 0u; d < ND; ++d) acc[d] = FRAG_C(0.0);
    for (uint j0 = 0u; j0 < jend; j0 += BC) {
        barrier();
        STAGE(KVs, 0u, k, k8, p.sk, j0, BC, b, h);
        STAGE(KVs, BC * HROW, v, v8, p.sk, j0, BC, b, h);
        barrier();
        [[unroll]] for (uint n = 0u; n < NB; ++n) {
            FRAG_C s, dp;
            SCORE_FRAG(s, qf, KVs, 0u, n);
            SCORE_FRAG(dp, gf, KVs, BC * HROW, n);
            for (uint e = 0u; e < uint(s.length()); ++e) {
                uint own = sg * FR + uint(rid[e]);
                float pij = exp(masked(s[e] * p.scale, b, h, i0 + own, j0 + n * FR + uint(cid[e])) - Lrow[own]);
                s[e] = pij * (dp[e] - Drow[own]);
            }
            STORE_F16(s, Ps, n);
        }
        subgroup_sync();
        ACCUMULATE(acc, Ps, KVs, 0u);
    }

    STORE_ROWS(dq, acc, p.scale, Ps, p.sq, i0 + sg * FR, b, h);
    if (part == 0u && row < p.sq) {
        uint si = stat_index(b, h, row);
        if (p.saved_lse == 0u) stats[si] = lse;
        stats[p.nstat + si] = drow;
    }
}
