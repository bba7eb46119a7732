#version 450
// Flash-attention backward, pass 1 of 2: a workgroup owns BR query rows of
// one head. With each row's m_i, log l_i and D_i = g_i . out_i (attn_bwd_stats),
// the sweep over the key tiles accumulates
//   p_ij = exp((s_ij - m_i) - log l_i), dp_ij = g_i . v_j, ds_ij = p_ij (dp_ij - D_i)
//   dq_i = scale * sum_j ds_ij k_j
#include "attn_tiles.glsl"

layout(std430, set = 0, binding = 4) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 5) readonly buffer Stats { float stats[]; };  // m, log l, D
layout(std430, set = 0, binding = 6) writeonly buffer DQ { T dq[]; };

shared vec4 Qs[BR * PAD];
shared vec4 Gs[BR * PAD];
shared vec4 KVs[KV_SLOTS * BC * PAD];  // K at 0, V at VOFF
shared vec4 Pt[BC * RG];               // ds of key j for row group rg's 4 rows

#if KV_SLOTS == 2
#define VOFF (BC * PAD)
#else
#define VOFF 0
#endif

void main() {
    uint t = gl_LocalInvocationID.x, rg = t / CT, c = t % CT;
    uvec3 tile = own_tile(true);
    uint h = tile.y, b = tile.z;
    uint i0 = tile.x * BR;
    uint nc = (p.dh + 3u) / 4u;

    LOAD_TILE(Qs, 0u, q, p.sq, i0, BR, b, h);
    LOAD_TILE(Gs, 0u, g, p.sq, i0, BR, b, h);
    barrier();
    uint jend = p.causal != 0u ? min(p.sk, i0 + BR) : p.sk;
    vec4 mrow = vec4(POS_INF), logl = vec4(0.0), drow = vec4(0.0);
    for (uint a = 0u; a < RQ; ++a) {
        uint i = i0 + rg * RQ + a;
        if (i < p.sq) {
            mrow[a] = stats[stat_index(b, h, i)];
            logl[a] = stats[p.nstat + stat_index(b, h, i)];
            drow[a] = stats[2u * p.nstat + stat_index(b, h, i)];
        }
    }

    vec4 acc[RQ][CPT];
    for (uint a = 0u; a < RQ; ++a)
        for (uint y = 0u; y < CPT; ++y) acc[a][y] = vec4(0.0);
    vec4 nk[FETCH_REGS], nv[FETCH_REGS];  // the next K and V tiles, in flight
    FETCH_TILE(nk, k, p.sk, 0u, b, h);
    FETCH_TILE(nv, v, p.sk, 0u, b, h);
    for (uint j0 = 0u; j0 < jend; j0 += BC) {
        bool more = j0 + BC < jend;
        barrier();
        PUT_TILE(KVs, VOFF, nv, v, p.sk, j0, b, h);
#if KV_SLOTS == 2
        PUT_TILE(KVs, 0u, nk, k, p.sk, j0, b, h);
        if (more) FETCH_TILE(nk, k, p.sk, j0 + BC, b, h);
#endif
        barrier();
        if (more) FETCH_TILE(nv, v, p.sk, j0 + BC, b, h);
        float dpv[RQ][KPT];
        TILE_DOTS(dpv, Gs, rg * RQ, KVs, (VOFF / PAD) + c, CT, nc);
#if KV_SLOTS == 1
        barrier();  // V is no longer read
        PUT_TILE(KVs, 0u, nk, k, p.sk, j0, b, h);
        barrier();
        if (more) FETCH_TILE(nk, k, p.sk, j0 + BC, b, h);
#endif
        vec4 dsv[KPT];
        float sc[RQ][KPT];
        TILE_DOTS(sc, Qs, rg * RQ, KVs, c, CT, nc);
        for (uint a = 0u; a < RQ; ++a) {
            for (uint x = 0u; x < KPT; ++x) {
                float pij = exp(masked(sc[a][x] * p.scale, b, h, i0 + rg * RQ + a, j0 + c + CT * x) - mrow[a] - logl[a]);
                dsv[x][a] = pij * (dpv[a][x] - drow[a]);
            }
        }
        for (uint x = 0u; x < KPT; ++x) Pt[(c + CT * x) * RG + rg] = dsv[x];
        barrier();
        uint cnt = min(uint(BC), p.sk - j0);
        for (uint jj = 0u; jj < BC; ++jj) {
            if (jj >= cnt) break;
            vec4 dj = Pt[jj * RG + rg];
            for (uint y = 0u; y < CPT; ++y) {
                vec4 kk = KVs[jj * PAD + c + CT * y];
                for (uint a = 0u; a < RQ; ++a) acc[a][y] += dj[a] * kk;
            }
        }
    }

    for (uint a = 0u; a < RQ; ++a) {
        uint i = i0 + rg * RQ + a;
        if (i >= p.sq) break;
        uint ob = row_base(b, p.sq, i, h);
        for (uint y = 0u; y < CPT; ++y) {
            uint ch = c + CT * y;
            for (uint e = 0u; e < 4u; ++e)
                if (4u * ch + e < p.dh) dq[ob + 4u * ch + e] = STORE(acc[a][y][e] * p.scale);
        }
    }
}
