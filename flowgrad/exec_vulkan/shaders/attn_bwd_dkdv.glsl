#version 450
// Flash-attention backward, pass 2 of 2: a workgroup owns BR key rows of one
// head and streams the query rows (q, g and the m_i, log l_i and D_i saved before it)
// in tiles of BC (causal: only tiles at or below the diagonal):
//   dv_j = sum_i p_ij g_i,   dk_j = scale * sum_i ds_ij q_i
// Each workgroup writes only its own rows of dk and dv: no atomics.
#include "attn_tiles.glsl"

layout(std430, set = 0, binding = 4) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 5) readonly buffer Stats { float stats[]; };
layout(std430, set = 0, binding = 6) writeonly buffer DK { T dk[]; };
layout(std430, set = 0, binding = 7) writeonly buffer DV { T dv[]; };

shared vec4 Ks[BR * PAD];
shared vec4 Vs[BR * PAD];
shared vec4 Qs[BC * PAD];
shared vec4 Gs[BC * PAD];
shared vec4 Pt[BC * RG];   // p of query i for row group rg's 4 keys
shared vec4 Dt[BC * RG];   // ds, likewise
shared float Ms[BC], LLs[BC];  // the streamed queries' m and log l
shared float Ds[BC];

void main() {
    uint t = gl_LocalInvocationID.x, rg = t / CT, c = t % CT;
    uvec3 tile = own_tile(false);
    uint h = tile.y, b = tile.z;
    uint j0 = tile.x * BR;
    uint nc = (p.dh + 3u) / 4u;

    LOAD_TILE(Ks, 0u, k, p.sk, j0, BR, b, h);
    LOAD_TILE(Vs, 0u, v, p.sk, j0, BR, b, h);
    vec4 dka[RQ][CPT], dva[RQ][CPT];
    for (uint a = 0u; a < RQ; ++a)
        for (uint y = 0u; y < CPT; ++y) {
            dka[a][y] = vec4(0.0);
            dva[a][y] = vec4(0.0);
        }

    uint sbase = stat_index(b, h, 0u);
    uint istart = p.causal != 0u ? (j0 / BC) * BC : 0u;
    vec4 nq[FETCH_REGS], ng[FETCH_REGS];  // the next Q and G tiles, in flight
    FETCH_TILE(nq, q, p.sq, istart, b, h);
    FETCH_TILE(ng, g, p.sq, istart, b, h);
    for (uint i0 = istart; i0 < p.sq; i0 += BC) {
        barrier();
        PUT_TILE(Qs, 0u, nq, q, p.sq, i0, b, h);
        PUT_TILE(Gs, 0u, ng, g, p.sq, i0, b, h);
        for (uint r = gl_LocalInvocationID.x; r < BC; r += NT) {
            bool in_seq = i0 + r < p.sq;
            Ms[r] = in_seq ? stats[sbase + i0 + r] : POS_INF;
            LLs[r] = in_seq ? stats[p.nstat + sbase + i0 + r] : 0.0;
            Ds[r] = in_seq ? stats[2u * p.nstat + sbase + i0 + r] : 0.0;
        }
        barrier();
        if (i0 + BC < p.sq) {
            FETCH_TILE(nq, q, p.sq, i0 + BC, b, h);
            FETCH_TILE(ng, g, p.sq, i0 + BC, b, h);
        }
        vec4 pv[KPT], dsv[KPT];
        float sv[RQ][KPT], dp[RQ][KPT];
        TILE_DOTS2(sv, Ks, Qs, dp, Vs, Gs, rg * RQ, c, CT, nc);
        for (uint x = 0u; x < KPT; ++x) {
            uint ii = c + CT * x;
            for (uint a = 0u; a < RQ; ++a) {
                float pij = exp(masked(sv[a][x] * p.scale, b, h, i0 + ii, j0 + rg * RQ + a) - Ms[ii] - LLs[ii]);
                pv[x][a] = pij;
                dsv[x][a] = pij * (dp[a][x] - Ds[ii]);
            }
            Pt[ii * RG + rg] = pv[x];
            Dt[ii * RG + rg] = dsv[x];
        }
        barrier();
        uint cnt = min(uint(BC), p.sq - i0);
        for (uint ii = 0u; ii < BC; ++ii) {
            if (ii >= cnt) break;
            vec4 pj = Pt[ii * RG + rg], dj = Dt[ii * RG + rg];
            for (uint y = 0u; y < CPT; ++y) {
                vec4 gg = Gs[ii * PAD + c + CT * y], qq = Qs[ii * PAD + c + CT * y];
                for (uint a = 0u; a < RQ; ++a) {
                    dva[a][y] += pj[a] * gg;
                    dka[a][y] += dj[a] * qq;
                }
            }
        }
    }

    for (uint a = 0u; a < RQ; ++a) {
        uint j = j0 + rg * RQ + a;
        if (j >= p.sk) break;
        uint kb = row_base(b, p.sk, j, h);
        for (uint y = 0u; y < CPT; ++y) {
            uint ch = c + CT * y;
            for (uint e = 0u; e < 4u; ++e) {
                if (4u * ch + e < p.dh) {
                    dk[kb + 4u * ch + e] = STORE(dka[a][y][e] * p.scale);
                    dv[kb + 4u * ch + e] = STORE(dva[a][y][e]);
                }
            }
        }
    }
}
