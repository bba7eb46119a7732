// compiler: glslc-2025 (GL_KHR_cooperative_matrix needs glslang 14 or newer)
#version 450
// Flash-attention forward on cooperative matrices (see attn_coop.glsl and,
// for the algorithm, attn_fwd.glsl): per key tile, S = Q K^T on fragments;
// the row's lanes mask and scale S, update the running max m and sum l, and
// write P = exp(S - m) as f16; the output fragments are rescaled by
// exp(m_old - m) and accumulate P V. The end divides by l and saves each
// row's log-sum-exp (+inf for a fully masked row, whose output is 0).
#define SCORE_ROWS
#include "attn_coop.glsl"

layout(std430, set = 0, binding = 4) writeonly buffer O { T o[]; };
layout(std430, set = 0, binding = 5) writeonly buffer Stats { float stats[]; };

shared uvec4 KVs[2 * BC * HROW];        // K at 0, V at BC * HROW (Q staged here first)
shared HT Ps[NSG * FR * PROW];   // each subgroup's probabilities
shared float Rowf[BR];                  // a factor per own row: the softmax's correction, then 1/l

// acc[d] rows scaled by Rowf of this subgroup's rows (Rowf written, the subgroup synced)
#define SCALE_ROWS(acc, ids)                                                         \
    [[unroll]] for (uint d_ = 0u; d_ < ND; ++d_)                                      \
        for (uint e_ = 0u; e_ < uint(acc[d_].length()); ++e_)                         \
            acc[d_][e_] *= Rowf[sg_index() * FR + uint(ids[e_])]


void main() {
    uint sg = sg_index(), r = lane_row(), part = lane_part();
    uvec3 tile = own_tile(true);
    uint h = tile.y, b = tile.z;
    uint i0 = tile.x * BR, row = i0 + sg * FR + r;

    fill_ids();
    STAGE(KVs, 0u, q, q8, p.sq, i0, BR, b, h);
    barrier();
    FRAG_C ids;
    LOAD_IDS(ids, RowIds);
    FRAG_A qf[ND];
    LOAD_ROWS_A(qf, KVs, 0u, sg * FR);
    FRAG_C acc[ND];
    [[unroll]] for (uint d = 0u; d < ND; ++d) acc[d] = FRAG_C(0.0);
    float m = NEG_INF, l = 0.0;   // the row's running max (same in its lanes) and this lane's share of its sum

    uint jend = p.causal != 0u ? min(p.sk, i0 + BR) : p.sk;
    for (uint j0 = 0u; j0 < jend; j0 += BC) {
        barrier();   // Q's fragments are loaded, the previous tile is no longer read
        STAGE(KVs, 0u, k, k8, p.sk, j0, BC, b, h);
        STAGE(KVs, BC * HROW, v, v8, p.sk, j0, BC, b, h);
        barrier();
        SCORES(Ss, qf, KVs, 0u);
        subgroup_sync();
        float s[PER_LANE], corr;
        float mref = online_step(j0, b, h, row, m, l, s, corr);
        [[unroll]] for (uint x = 0u; x < PER_LANE; ++x) {
            float pv = exp(s[x] - mref);
            l += pv;
            Ps[(sg * FR + r) * PROW + part + LPR * x] = HT(pv);
        }
        if (part == 0u) Rowf[sg * FR + r] = corr;
        subgroup_sync();
        SCALE_ROWS(acc, ids);
        ACCUMULATE(acc, Ps, KVs, BC * HROW);
    }

    l = row_sum(l);
    if (part == 0u) {
        Rowf[sg * FR + r] = l > 0.0 ? 1.0 / l : 0.0;   // a fully masked row gives 0
        if (row < p.sq) {
            stats[stat_index(b, h, row)] = l > 0.0 ? m : POS_INF;
            stats[p.nstat + stat_index(b, h, row)] = l > 0.0 ? log(l) : 0.0;
        }
    }
    subgroup_sync();
    SCALE_ROWS(acc, ids);
    STORE_ROWS(o, acc, 1.0, Ps, p.sq, i0 + sg * FR, b, h);
}
