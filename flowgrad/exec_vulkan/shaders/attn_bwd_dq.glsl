#version 450
// Flash-attention backward, pass 1 of 2: a workgroup owns BR query rows of
// one head. Each row's log-sum-exp is the forward's (saved_lse: read from
// stats) or, where the forward ran in another recording, recomputed by a
// first sweep over the key tiles (each thread an online softmax over its own
// keys, merged once at the end). The sweep over the key tiles accumulates
//   p_ij = exp(s_ij - lse_i), dp_ij = g_i . v_j, ds_ij = p_ij (dp_ij - D_i)
//   dq_i = scale * sum_j ds_ij k_j        with D_i = g_i . out_i
// and D_i (and a recomputed lse_i) are saved for the dk/dv pass. A fully masked row saves
// lse = +inf, so every p_ij of it is 0 here and in the dk/dv pass.
#include "attn_tiles.glsl"

layout(std430, set = 0, binding = 4) readonly buffer O { T o[]; };
layout(std430, set = 0, binding = 5) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 6) writeonly buffer DQ { T dq[]; };
layout(std430, set = 0, binding = 7) buffer Stats { float stats[]; };  // lse then D

shared vec4 Qs[BR * PAD];
shared vec4 Gs[BR * PAD];
shared vec4 KVs[KV_SLOTS * BC * PAD];  // K at 0, V at VOFF
shared vec4 Pt[BC * RG];               // ds of key j for row group rg's 4 rows
shared vec4 red[CT * RG];

#if KV_SLOTS == 2
#define VOFF (BC * PAD)
#else
#define VOFF 0
#endif

// every thread of row group rg gets the sum over its CT threads of x
vec4 group_sum(vec4 x, uint rg, uint c) {
    barrier();
    red[c * RG + rg] = x;
    barrier();
    vec4 t = vec4(0.0);
    for (uint cc = 0u; cc < CT; ++cc) t += red[cc * RG + rg];
    return t;
}

// The rows' log-sum-exp from a sweep over the key tiles (every thread of
// the workgroup takes part; uniform control flow).
vec4 recompute_lse(uint b, uint h, uint i0, uint jend, uint rg, uint c, uint nc) {
    vec4 m = vec4(NEG_INF), l = vec4(0.0);
    for (uint j0 = 0u; j0 < jend; j0 += BC) {
        barrier();
        LOAD_TILE(KVs, 0u, k, p.sk, j0, BC, b, h);
        barrier();
        float sc[RQ][KPT];
        TILE_DOTS(sc, Qs, rg * RQ, KVs, c, CT, nc);
        for (uint a = 0u; a < RQ; ++a) {
            for (uint x = 0u; x < KPT; ++x) {
                float sv = masked(sc[a][x] * p.scale, b, h, i0 + rg * RQ + a, j0 + c + CT * x);
                float mnew = max(m[a], sv);
                float mref = mnew == NEG_INF ? 0.0 : mnew;
                l[a] = l[a] * exp(m[a] - mref) + exp(sv - mref);
                m[a] = mnew;
            }
        }
    }
    barrier();
    red[c * RG + rg] = m;
    barrier();
    vec4 mrow = vec4(NEG_INF);
    for (uint cc = 0u; cc < CT; ++cc) mrow = max(mrow, red[cc * RG + rg]);
    vec4 mine = vec4(0.0);
    for (uint a = 0u; a < RQ; ++a) mine[a] = m[a] == NEG_INF ? 0.0 : l[a] * exp(m[a] - mrow[a]);
    vec4 lrow = group_sum(mine, rg, c);
    vec4 lse;
    for (uint a = 0u; a < RQ; ++a) lse[a] = mrow[a] == NEG_INF ? POS_INF : mrow[a] + log(lrow[a]);
    return lse;
}

void main() {
    uint t = gl_LocalInvocationID.x, rg = t / CT, c = t % CT;
    uint h = gl_WorkGroupID.y, b = gl_WorkGroupID.z;
    uint i0 = gl_WorkGroupID.x * BR;
    uint nc = (p.dh + 3u) / 4u;

    LOAD_TILE(Qs, 0u, q, p.sq, i0, BR, b, h);
    LOAD_TILE(Gs, 0u, g, p.sq, i0, BR, b, h);
    barrier();
    vec4 dpart = vec4(0.0);  // this thread's share of D_i = g_i . out_i
    for (uint a = 0u; a < RQ; ++a) {
        uint i = i0 + rg * RQ + a;
        if (i >= p.sq) break;
        uint ob = row_base(b, p.sq, i, h);
        for (uint y = 0u; y < CPT; ++y) {
            uint ch = c + CT * y;
            for (uint e = 0u; e < 4u; ++e)
                if (4u * ch + e < p.dh) dpart[a] += Gs[(rg * RQ + a) * PAD + ch][e] * LOAD(o[ob + 4u * ch + e]);
        }
    }
    vec4 drow = group_sum(dpart, rg, c);

    uint jend = p.causal != 0u ? min(p.sk, i0 + BR) : p.sk;
    vec4 lse = vec4(POS_INF);
    if (p.saved_lse != 0u) {
        for (uint a = 0u; a < RQ; ++a)
            if (i0 + rg * RQ + a < p.sq) lse[a] = stats[stat_index(b, h, i0 + rg * RQ + a)];
    } else {
        lse = recompute_lse(b, h, i0, jend, rg, c, nc);
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
                float pij = exp(masked(sc[a][x] * p.scale, b, h, i0 + rg * RQ + a, j0 + c + CT * x) - lse[a]);
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
        if (c == 0u) {
            uint si = stat_index(b, h, i);
            if (p.saved_lse == 0u) stats[si] = lse[a];
            stats[p.nstat + si] = drow[a];
        }
    }
}
