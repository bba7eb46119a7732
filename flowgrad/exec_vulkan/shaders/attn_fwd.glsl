#version 450
// Flash-attention forward. A workgroup owns BR query rows of one head and
// streams the keys in tiles of BC (causal: only tiles at or left of the
// diagonal), keeping per row an online softmax (running max m, sum l) and
// an unnormalised output; no [seq, seq] score matrix exists beyond a tile.
// A fully masked row gives 0, as PyTorch's SDPA does. Each row's
// m and log l go to stats for the backward (m = +inf for a fully masked row).
#include "attn_tiles.glsl"

layout(std430, set = 0, binding = 4) writeonly buffer O { T o[]; };
layout(std430, set = 0, binding = 5) writeonly buffer Stats { float stats[]; };

shared vec4 Qs[BR * PAD];
shared vec4 KVs[KV_SLOTS * BC * PAD];
shared vec4 Pt[BC * RG];   // Pt[j * RG + rg]: key j's probabilities for row group rg's 4 rows
shared vec4 red[CT * RG];  // per-thread partial row statistics

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
    vec4 acc[RQ][CPT];
    float m[RQ], l[RQ];
    for (uint a = 0u; a < RQ; ++a) {
        m[a] = NEG_INF;
        l[a] = 0.0;
        for (uint y = 0u; y < CPT; ++y) acc[a][y] = vec4(0.0);
    }

    uint jend = p.causal != 0u ? min(p.sk, i0 + BR) : p.sk;
    vec4 nk[FETCH_REGS], nv[FETCH_REGS];  // the next K and V tiles, in flight
    FETCH_TILE(nk, k, p.sk, 0u, b, h);
    FETCH_TILE(nv, v, p.sk, 0u, b, h);
    for (uint j0 = 0u; j0 < jend; j0 += BC) {
        bool more = j0 + BC < jend;
        barrier();  // the previous tile is no longer read
        PUT_TILE(KVs, 0u, nk, k, p.sk, j0, b, h);
#if KV_SLOTS == 2
        PUT_TILE(KVs, VOFF, nv, v, p.sk, j0, b, h);
        if (more) FETCH_TILE(nv, v, p.sk, j0 + BC, b, h);
#endif
        barrier();
        if (more) FETCH_TILE(nk, k, p.sk, j0 + BC, b, h);
        float s[RQ][KPT];
        TILE_DOTS(s, Qs, rg * RQ, KVs, c, CT, nc);
        vec4 tmax = vec4(NEG_INF);
        for (uint a = 0u; a < RQ; ++a) {
            for (uint x = 0u; x < KPT; ++x) {
                s[a][x] = masked(s[a][x] * p.scale, b, h, i0 + rg * RQ + a, j0 + c + CT * x);
                tmax[a] = max(tmax[a], s[a][x]);
            }
        }
        red[c * RG + rg] = tmax;
        barrier();
        for (uint cc = 0u; cc < CT; ++cc) tmax = max(tmax, red[cc * RG + rg]);
        vec4 pv[KPT];
        for (uint a = 0u; a < RQ; ++a) {
            float mnew = max(m[a], tmax[a]);
            // while every score so far is -inf, shift by 0 so exp() gives 0, not NaN
            float mref = mnew == NEG_INF ? 0.0 : mnew;
            float corr = exp(m[a] - mref);
            l[a] *= corr;
            for (uint y = 0u; y < CPT; ++y) acc[a][y] *= corr;
            for (uint x = 0u; x < KPT; ++x) {
                pv[x][a] = exp(s[a][x] - mref);
                l[a] += pv[x][a];
            }
            m[a] = mnew;
        }
        for (uint x = 0u; x < KPT; ++x) Pt[(c + CT * x) * RG + rg] = pv[x];
#if KV_SLOTS == 1
        barrier();  // K is no longer read
        PUT_TILE(KVs, 0u, nv, v, p.sk, j0, b, h);
        if (more) FETCH_TILE(nv, v, p.sk, j0 + BC, b, h);
#endif
        barrier();
        uint cnt = min(uint(BC), p.sk - j0);
        for (uint jj = 0u; jj < BC; ++jj) {
            if (jj >= cnt) break;
            vec4 pj = Pt[jj * RG + rg];
            for (uint y = 0u; y < CPT; ++y) {
                vec4 vv = KVs[VOFF + jj * PAD + c + CT * y];
                for (uint a = 0u; a < RQ; ++a) acc[a][y] += pj[a] * vv;
            }
        }
    }

    barrier();
    red[c * RG + rg] = vec4(l[0], l[1], l[2], l[3]);
    barrier();
    vec4 lsum = vec4(0.0);
    for (uint cc = 0u; cc < CT; ++cc) lsum += red[cc * RG + rg];
    for (uint a = 0u; a < RQ; ++a) {
        uint i = i0 + rg * RQ + a;
        if (i >= p.sq) break;
        float inv = lsum[a] > 0.0 ? 1.0 / lsum[a] : 0.0;  // a fully masked row gives 0
        if (c == 0u) {
            stats[stat_index(b, h, i)] = lsum[a] > 0.0 ? m[a] : POS_INF;
            stats[p.nstat + stat_index(b, h, i)] = lsum[a] > 0.0 ? log(lsum[a]) : 0.0;
        }
        uint ob = row_base(b, p.sq, i, h);
        for (uint y = 0u; y < CPT; ++y) {
            uint ch = c + CT * y;
            for (uint e = 0u; e < 4u; ++e)
                if (4u * ch + e < p.dh) o[ob + 4u * ch + e] = STORE(acc[a][y][e] * inv);
        }
    }
}
