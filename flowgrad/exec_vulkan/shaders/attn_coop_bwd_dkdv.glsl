// compiler: glslc-2025 (GL_KHR_cooperative_matrix needs glslang 14 or newer)
#version 450
// Flash-attention backward, pass 2 of 2, on cooperative matrices (see
// attn_coop.glsl and, for the algorithm, attn_bwd_dkdv.glsl): a workgroup
// owns BR key rows and streams the query rows. Per query tile, S^T = K Q^T
// and dP^T = V G^T on fragments; the key row's lanes form P^T = exp(S^T -
// lse) and dS^T = P^T (dP^T - D) as f16; dV += P^T G and dK += dS^T Q on
// fragments. Each workgroup writes only its own rows of dk and dv.
#include "attn_coop.glsl"

layout(std430, set = 0, binding = 4) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 4) readonly buffer G8 { uvec4 g8[]; };
layout(std430, set = 0, binding = 5) readonly buffer Stats { float stats[]; };
layout(std430, set = 0, binding = 6) writeonly buffer DK { T dk[]; };
layout(std430, set = 0, binding = 7) writeonly buffer DV { T dv[]; };

shared uvec4 QGs[2 * BC * HROW];        // Q at 0, G at BC * HROW (K, then V, staged here first)
shared float DPs[NSG * FR * SROW];      // each subgroup's dP^T
shared float16_t Ps[NSG * FR * PROW];   // each subgroup's P^T
shared float16_t DSs[NSG * FR * PROW];  // each subgroup's dS^T
shared float Ls[BC];                    // the streamed queries' lse
shared float Ds[BC];                    // and D

void main() {
    uint sg = sg_index(), r = lane_row(), part = lane_part();
    uint h = gl_WorkGroupID.y, b = gl_WorkGroupID.z;
    uint j0 = gl_WorkGroupID.x * BR, key = j0 + sg * FR + r;

    FRAG_A kf[ND], vf[ND];
    OWN_ROWS(kf, k, k8, vf, v, v8, QGs, p.sk, j0, b, h);
    FRAG_C dka[ND], dva[ND];
    [[unroll]] for (uint d = 0u; d < ND; ++d) {
        dka[d] = FRAG_C(0.0);
        dva[d] = FRAG_C(0.0);
    }

    uint sbase = stat_index(b, h, 0u);
    uint istart = p.causal != 0u ? (j0 / BC) * BC : 0u;
    for (uint i0 = istart; i0 < p.sq; i0 += BC) {
        barrier();
        STAGE(QGs, 0u, q, q8, p.sq, i0, BC, b, h);
        STAGE(QGs, BC * HROW, g, g8, p.sq, i0, BC, b, h);
        for (uint c = gl_LocalInvocationIndex; c < BC; c += NT) {
            bool in_seq = i0 + c < p.sq;
            Ls[c] = in_seq ? stats[sbase + i0 + c] : POS_INF;
            Ds[c] = in_seq ? stats[p.nstat + sbase + i0 + c] : 0.0;
        }
        barrier();
        SCORES(Ss, kf, QGs, 0u);
        SCORES(DPs, vf, QGs, BC * HROW);
        subgroup_sync();
        [[unroll]] for (uint x = 0u; x < PER_LANE; ++x) {
            uint c = part + LPR * x, at = (sg * FR + r) * SROW + c, pt = (sg * FR + r) * PROW + c;
            float pij = exp(masked(Ss[at] * p.scale, b, h, i0 + c, key) - Ls[c]);
            Ps[pt] = float16_t(pij);
            DSs[pt] = float16_t(pij * (DPs[at] - Ds[c]));
        }
        subgroup_sync();
        ACCUMULATE(dva, Ps, QGs, BC * HROW);
        ACCUMULATE(dka, DSs, QGs, 0u);
    }

    STORE_ROWS(dk, dka, p.scale, Ss, p.sk, j0 + sg * FR, b, h);
    STORE_ROWS(dv, dva, 1.0, Ss, p.sk, j0 + sg * FR, b, h);
}
