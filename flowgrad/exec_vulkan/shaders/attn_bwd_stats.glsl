#version 450
// Flash-attention backward, before its two passes: a workgroup owns BR query
// rows of one head and saves, for each,
//   D_i = g_i . out_i
// and, where the forward ran in another recording (saved_lse 0), its
// score max m and log l from a sweep over the key tiles (each thread an online
// softmax over its own keys, merged once at the end). A fully masked row saves
// m = +inf, so every p_ij of it is 0 in both passes. The dq and dk/dv
// passes only read these statistics, so nothing orders one after the other.
#define NO_V
#include "attn_tiles.glsl"

layout(std430, set = 0, binding = 2) readonly buffer O { T o[]; };
layout(std430, set = 0, binding = 4) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 5) writeonly buffer Stats { float stats[]; };  // m, log l, D

shared vec4 Qs[BR * PAD];
shared vec4 Ks[BC * PAD];
shared vec4 red[CT * RG];

// every thread of row group rg gets the sum over its CT threads of x
vec4 group_sum(vec4 x, uint rg, uint c) {
    barrier();
    red[c * RG + rg] = x;
    barrier();
    vec4 t = vec4(0.0);
    for (uint cc = 0u; cc < CT; ++cc) t += red[cc * RG + rg];
    return t;
}

// The rows' m and log l from a sweep over the key tiles (every thread of
// the workgroup takes part; uniform control flow).
void recompute_stats(uint b, uint h, uint i0, uint jend, uint rg, uint c, uint nc, out vec4 mout, out vec4 logl) {
    vec4 m = vec4(NEG_INF), l = vec4(0.0);
    for (uint j0 = 0u; j0 < jend; j0 += BC) {
        barrier();
        LOAD_TILE(Ks, 0u, k, p.sk, j0, BC, b, h);
        barrier();
        float sc[RQ][KPT];
        TILE_DOTS(sc, Qs, rg * RQ, Ks, c, CT, nc);
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
    for (uint a = 0u; a < RQ; ++a) {
        mout[a] = mrow[a] == NEG_INF ? POS_INF : mrow[a];
        logl[a] = mrow[a] == NEG_INF ? 0.0 : log(lrow[a]);
    }
}

void main() {
    uint t = gl_LocalInvocationID.x, rg = t / CT, c = t % CT;
    uvec3 tile = own_tile(true);
    uint h = tile.y, b = tile.z;
    uint i0 = tile.x * BR;
    uint nc = (p.dh + 3u) / 4u;

    vec4 dpart = vec4(0.0);  // this thread's share of D_i
    for (uint a = 0u; a < RQ; ++a) {
        uint i = i0 + rg * RQ + a;
        if (i >= p.sq) break;
        uint base = row_base(b, p.sq, i, h);
        for (uint y = 0u; y < CPT; ++y) {
            uint ch = c + CT * y;
            for (uint e = 0u; e < 4u; ++e)
                if (4u * ch + e < p.dh) dpart[a] += LOAD(g[base + 4u * ch + e]) * LOAD(o[base + 4u * ch + e]);
        }
    }
    vec4 drow = group_sum(dpart, rg, c);

    vec4 mrow = vec4(POS_INF), logl = vec4(0.0);
    if (p.saved_lse == 0u) {
        LOAD_TILE(Qs, 0u, q, p.sq, i0, BR, b, h);
        recompute_stats(b, h, i0, p.causal != 0u ? min(p.sk, i0 + BR) : p.sk, rg, c, nc, mrow, logl);
    }

    if (c != 0u) return;
    for (uint a = 0u; a < RQ; ++a) {
        uint i = i0 + rg * RQ + a;
        if (i >= p.sq) break;
        uint si = stat_index(b, h, i);
        if (p.saved_lse == 0u) {
            stats[si] = mrow[a];
            stats[p.nstat + si] = logl[a];
        }
        stats[2u * p.nstat + si] = drow[a];
    }
}
