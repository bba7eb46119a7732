// compiler: glslc-2025 (GL_KHR_cooperative_matrix needs glslang 14 or newer)
#version 450
// Flash-attention backward, pass 2 of 2, on cooperative matrices (see
// attn_coop.glsl and, for the algorithm, attn_bwd_dkdv.glsl): a workgroup
// owns BR key rows and streams the query rows. Per query tile, S^T = K Q^T
// and dP^T = V G^T on fragments, and P^T = exp(S^T - m - log l) and dS^T = P^T
// (dP^T - D) on their elements, stored as f16 and read back as A fragments
// for dV += P^T G and dK += dS^T Q. Each workgroup writes only its own rows
// of dk and dv. The attn_cm2 build (CM2) turns P^T and dS^T into A fragments
// in place (VK_NV_cooperative_matrix2's conversions), fetches the next Q and
// G rows into registers while a tile's products run, exponentiates in base 2
// and masks only the tiles that need it.
#ifdef CM2
#define PROW (FR + 8)          // DSs only stages the output rows
#endif
#include "attn_coop.glsl"

layout(std430, set = 0, binding = 4) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 4) readonly buffer G8 { uvec4 g8[]; };
layout(std430, set = 0, binding = 5) readonly buffer Stats { float stats[]; };
layout(std430, set = 0, binding = 6) writeonly buffer DK { T dk[]; };
layout(std430, set = 0, binding = 7) writeonly buffer DV { T dv[]; };

shared uvec4 QGs[2 * BC * HROW];        // Q at 0, G at BC * HROW (K, then V, staged here first)
#ifndef CM2
shared HT Ps[NSG * FR * PROW];   // each subgroup's P^T
#endif
shared HT DSs[NSG * FR * PROW];  // each subgroup's dS^T (CM2: its output rows on their way out)
shared float Ms[BC], LLs[BC];           // the streamed queries' m and log l
shared float Ds[BC];                    // and D

void main() {
    uint sg = sg_index();
    uvec3 tile = own_tile(false);
    uint h = tile.y, b = tile.z;
    uint j0 = tile.x * BR;

    fill_ids();
    FRAG_A kf[ND], vf[ND];
    OWN_ROWS(kf, k, k8, vf, v, v8, QGs, p.sk, j0, b, h);
#ifdef CM2
    FRAG_C cid;
    LOAD_IDS(cid, ColIds);
    float scale2 = p.scale * LOG2E;
#define STAT_UNIT LOG2E   // the streamed queries' m and log l in log2 units
#else
    FRAG_C rid, cid;
    LOAD_IDS(rid, RowIds);
    LOAD_IDS(cid, ColIds);
#define STAT_UNIT 1.0
#endif
    FRAG_C dka[ND], dva[ND];
    [[unroll]] for (uint d = 0u; d < ND; ++d) {
        dka[d] = FRAG_C(0.0);
        dva[d] = FRAG_C(0.0);
    }

    uint sbase = stat_index(b, h, 0u);
    uint istart = p.causal != 0u ? (j0 / BC) * BC : 0u;
#ifdef CM2
    uvec4 qr[FETCH_N], gr[FETCH_N];
    FETCH_TILE(qr, q, q8, p.sq, istart, b, h);
    FETCH_TILE(gr, g, g8, p.sq, istart, b, h);
#endif
    for (uint i0 = istart; i0 < p.sq; i0 += BC) {
        barrier();
#ifdef CM2
        PUT_TILE(QGs, 0u, qr);
        PUT_TILE(QGs, BC * HROW, gr);
#else
        STAGE(QGs, 0u, q, q8, p.sq, i0, BC, b, h);
        STAGE(QGs, BC * HROW, g, g8, p.sq, i0, BC, b, h);
#endif
        for (uint c = gl_LocalInvocationIndex; c < BC; c += NT) {
            bool in_seq = i0 + c < p.sq;
            Ms[c] = in_seq ? stats[sbase + i0 + c] * STAT_UNIT : POS_INF;
            LLs[c] = in_seq ? stats[p.nstat + sbase + i0 + c] * STAT_UNIT : 0.0;
            Ds[c] = in_seq ? stats[2u * p.nstat + sbase + i0 + c] : 0.0;
        }
        barrier();
#ifdef CM2
        if (i0 + BC < p.sq) {
            FETCH_TILE(qr, q, q8, p.sq, i0 + BC, b, h);
            FETCH_TILE(gr, g, g8, p.sq, i0 + BC, b, h);
        }
#endif
        // P^T and dS^T on the fragments' elements, each query's m, log l and D by its column id
        [[unroll]] for (uint n = 0u; n < NB; ++n) {
            FRAG_C s, dp;
            SCORE_FRAG(s, kf, QGs, 0u, n);
            SCORE_FRAG(dp, vf, QGs, BC * HROW, n);
#ifdef CM2
            // only a tile that crosses the diagonal, the queries' end or a mask masks its elements
            if (p.mask_mode != 0u || i0 + BC > p.sq || (p.causal != 0u && i0 + 1u < j0 + (sg + 1u) * FR)) {
                FRAG_C rid;
                LOAD_IDS(rid, RowIds);
                [[unroll]] for (uint e = 0u; e < uint(s.length()); ++e)
                    s[e] = LOG2E * masked(s[e] * p.scale, b, h, i0 + n * FR + uint(cid[e]), j0 + sg * FR + uint(rid[e]));
            } else {
                s = s * scale2;
            }
            [[unroll]] for (uint e = 0u; e < uint(s.length()); ++e) {
                uint c = n * FR + uint(cid[e]);
                float pij = exp2((s[e] - Ms[c]) - LLs[c]);
                s[e] = pij;
                dp[e] = pij * (dp[e] - Ds[c]);
            }
#else
            [[unroll]] for (uint e = 0u; e < uint(s.length()); ++e) {
                uint c = n * FR + uint(cid[e]);
                float pij = exp(masked(s[e] * p.scale, b, h, i0 + c, j0 + sg * FR + uint(rid[e])) - Ms[c] - LLs[c]);
                s[e] = pij;
                dp[e] = pij * (dp[e] - Ds[c]);
            }
#endif
#ifdef CM2
            ACCUMULATE_FRAG(dva, s, QGs, BC * HROW, n);
            ACCUMULATE_FRAG(dka, dp, QGs, 0u, n);
#else
            STORE_F16(s, Ps, n);
            STORE_F16(dp, DSs, n);
#endif
        }
#ifndef CM2
        subgroup_sync();
        ACCUMULATE(dva, Ps, QGs, BC * HROW);
        ACCUMULATE(dka, DSs, QGs, 0u);
#endif
    }

    STORE_ROWS(dk, dka, p.scale, DSs, p.sk, j0 + sg * FR, b, h);
    STORE_ROWS(dv, dva, 1.0, DSs, p.sk, j0 + sg * FR, b, h);
}
