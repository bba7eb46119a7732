// Flash-attention forward: the LANES threads of a query row stream the keys
// through shared memory in tiles, each keeping an online softmax (running
// max m, sum l) and an unnormalised output over its share of the keys; the
// shares merge at the end. No [seq, seq] score matrix exists beyond a tile.
// A fully masked row gives 0/0 = NaN, as the numpy reference does.
#include "common.glsl"
#include "attn_common.glsl"

layout(std430, set = 0, binding = 0) readonly buffer Q { T q[]; };
layout(std430, set = 0, binding = 1) readonly buffer K { T k[]; };
layout(std430, set = 0, binding = 2) readonly buffer V { T v[]; };
layout(std430, set = 0, binding = 3) readonly buffer Mask { T mask[]; };
layout(std430, set = 0, binding = 4) writeonly buffer O { T o[]; };

shared vec4 Ks[TILE * PAD];
shared vec4 Vs[TILE * PAD];

void main() {
    uint row = gl_LocalInvocationID.x / LANES, lane = gl_LocalInvocationID.x % LANES;
    uint h = gl_WorkGroupID.y, b = gl_WorkGroupID.z;
    uint i = gl_WorkGroupID.x * ROWS + row;
    bool live = i < p.sq;
    uint nc = (p.dh + 3u) / 4u;

    vec4 qv[NC], acc[NC];
    uint qb = row_base(b, p.sq, live ? i : 0u, h);
    for (uint c = 0u; c < NC; ++c) {
        qv[c] = vec4(0.0);
        acc[c] = vec4(0.0);
        for (uint e = 0u; e < 4u; ++e)
            if (live && 4u * c + e < p.dh) qv[c][e] = LOAD(q[qb + 4u * c + e]);
    }

    float m = NEG_INF, l = 0.0;
    for (uint j0 = 0u; j0 < p.sk; j0 += TILE) {
        uint cnt = min(uint(TILE), p.sk - j0);
        barrier();  // the previous tile is no longer read
        for (uint e = gl_LocalInvocationID.x; e < TILE * 4u * nc; e += ROWS * LANES) {
            uint r = e / (4u * nc), col = e % (4u * nc);
            float kx = 0.0, vx = 0.0;
            if (r < cnt && col < p.dh) {
                uint kb = row_base(b, p.sk, j0 + r, h) + col;
                kx = LOAD(k[kb]);
                vx = LOAD(v[kb]);
            }
            Ks[r * PAD + col / 4u][col % 4u] = kx;
            Vs[r * PAD + col / 4u][col % 4u] = vx;
        }
        barrier();
        if (!live) continue;

        float s[PER_LANE];
        float tmax = NEG_INF;
        for (uint x = 0u; x < PER_LANE; ++x) {
            uint jj = x * LANES + lane;
            s[x] = NEG_INF;
            if (jj < cnt) {
                float dotp = 0.0;
                for (uint c = 0u; c < NC; ++c)
                    if (c < nc) dotp += dot(qv[c], Ks[jj * PAD + c]);
                float sv = dotp * p.scale;
                if (p.has_mask != 0u) sv += LOAD(mask[i * p.msi + (j0 + jj) * p.msj]);
                s[x] = sv;
                tmax = max(tmax, sv);
            }
        }
        float mnew = max(m, tmax);
        // while every score so far is -inf, shift by 0 so exp() gives 0, not NaN
        float mref = mnew == NEG_INF ? 0.0 : mnew;
        float corr = exp(m - mref);
        l *= corr;
        for (uint c = 0u; c < NC; ++c) acc[c] *= corr;
        for (uint x = 0u; x < PER_LANE; ++x) {
            uint jj = x * LANES + lane;
            if (jj < cnt) {
                float pj = exp(s[x] - mref);
                l += pj;
                for (uint c = 0u; c < NC; ++c)
                    if (c < nc) acc[c] += pj * Vs[jj * PAD + c];
            }
        }
        m = mnew;
    }

    float mine = m;
    lanes_softmax(m, l, row, lane);
    float mref = m == NEG_INF ? 0.0 : m;
    lanes_sum(acc, exp(mine - mref) / l, nc, row, lane);
    if (!live) return;
    for (uint c = 0u; c < NC; ++c)
        if (c % LANES == lane)  // each lane writes a quarter of the row
            for (uint e = 0u; e < 4u; ++e)
                if (4u * c + e < p.dh) o[qb + 4u * c + e] = STORE(acc[c][e]);
}
