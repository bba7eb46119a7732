// Flash-attention forward: each thread owns one query row and streams the
// keys through shared memory in tiles, keeping an online softmax (running
// max m and sum l) and an unnormalised output accumulator, so no [seq, seq]
// score matrix exists beyond one tile. A fully masked row gives 0/0 = NaN,
// as the numpy reference does.
#include "common.glsl"
#include "attn_common.glsl"

layout(std430, set = 0, binding = 0) readonly buffer Q { T q[]; };
layout(std430, set = 0, binding = 1) readonly buffer K { T k[]; };
layout(std430, set = 0, binding = 2) readonly buffer V { T v[]; };
layout(std430, set = 0, binding = 3) readonly buffer Mask { T mask[]; };
layout(std430, set = 0, binding = 4) writeonly buffer O { T o[]; };

shared vec4 Ks[TILE][NC];
shared vec4 Vs[TILE][NC];

void main() {
    uint t = gl_LocalInvocationID.x;
    uint h = gl_WorkGroupID.y, b = gl_WorkGroupID.z;
    uint i = gl_WorkGroupID.x * ROWS + t;
    bool live = i < p.sq;
    uint nc = (p.dh + 3u) / 4u;

    vec4 qv[NC], acc[NC];
    uint qb = row_base(b, p.sq, live ? i : 0u, h);
    for (uint c = 0u; c < NC; ++c) {
        qv[c] = vec4(0.0);
        acc[c] = vec4(0.0);
        for (uint e = 0u; e < 4u; ++e)
            if (live && 4u * c + e < p.dh) qv[c][e] = float(q[qb + 4u * c + e]);
    }

    float m = NEG_INF, l = 0.0;
    for (uint j0 = 0u; j0 < p.sk; j0 += TILE) {
        uint cnt = min(uint(TILE), p.sk - j0);
        barrier();  // the previous tile is no longer read
        for (uint e = t; e < TILE * 4u * nc; e += ROWS) {
            uint r = e / (4u * nc), col = e % (4u * nc);
            float kv = 0.0, vv = 0.0;
            if (r < cnt && col < p.dh) {
                uint kb = row_base(b, p.sk, j0 + r, h) + col;
                kv = float(k[kb]);
                vv = float(v[kb]);
            }
            Ks[r][col / 4u][col % 4u] = kv;
            Vs[r][col / 4u][col % 4u] = vv;
        }
        barrier();
        if (!live) continue;

        float s[TILE];
        float tmax = NEG_INF;
        for (uint jj = 0u; jj < TILE; ++jj) {
            s[jj] = NEG_INF;
            if (jj < cnt) {
                float dotp = 0.0;
                for (uint c = 0u; c < NC; ++c)
                    if (c < nc) dotp += dot(qv[c], Ks[jj][c]);
                float sv = dotp * p.scale;
                if (p.has_mask != 0u) sv += float(mask[i * p.msi + (j0 + jj) * p.msj]);
                s[jj] = sv;
                tmax = max(tmax, sv);
            }
        }
        float mnew = max(m, tmax);
        // while every score so far is -inf, shift by 0 so exp() gives 0, not NaN
        float mref = mnew == NEG_INF ? 0.0 : mnew;
        float corr = exp(m - mref);
        l *= corr;
        for (uint c = 0u; c < NC; ++c) acc[c] *= corr;
        for (uint jj = 0u; jj < TILE; ++jj) {
            if (jj < cnt) {
                float pj = exp(s[jj] - mref);
                l += pj;
                for (uint c = 0u; c < NC; ++c)
                    if (c < nc) acc[c] += pj * Vs[jj][c];
            }
        }
        m = mnew;
    }
    if (!live) return;
    for (uint c = 0u; c < NC; ++c)
        for (uint e = 0u; e < 4u; ++e)
            if (4u * c + e < p.dh) o[qb + 4u * c + e] = T(acc[c][e] / l);
}
