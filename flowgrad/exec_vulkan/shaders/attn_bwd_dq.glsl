// Flash-attention backward, pass 1 of 2 (f32): the LANES threads of a query
// row split the keys. A first sweep recomputes the row's log-sum-exp; the
// second accumulates
//   p_ij = exp(s_ij - lse_i), dp_ij = g_i . v_j, ds_ij = p_ij (dp_ij - D_i)
//   dq_i = scale * sum_j ds_ij k_j        with D_i = g_i . out_i
// and lse_i, D_i are saved for the dk/dv pass. Keys stream through shared
// memory; nothing [seq, seq] is stored.
#include "attn_common.glsl"

layout(std430, set = 0, binding = 0) readonly buffer Q { float q[]; };
layout(std430, set = 0, binding = 1) readonly buffer K { float k[]; };
layout(std430, set = 0, binding = 2) readonly buffer V { float v[]; };
layout(std430, set = 0, binding = 3) readonly buffer O { float o[]; };
layout(std430, set = 0, binding = 4) readonly buffer G { float g[]; };
layout(std430, set = 0, binding = 5) readonly buffer Mask { float mask[]; };
layout(std430, set = 0, binding = 6) writeonly buffer DQ { float dq[]; };
layout(std430, set = 0, binding = 7) writeonly buffer Stats { float stats[]; };  // lse then D

shared vec4 Ks[TILE * PAD];
shared vec4 Vs[TILE * PAD];

void load_tile(uint b, uint h, uint j0, uint cnt, uint nc, bool with_v) {
    for (uint e = gl_LocalInvocationID.x; e < TILE * 4u * nc; e += ROWS * LANES) {
        uint r = e / (4u * nc), col = e % (4u * nc);
        float kx = 0.0, vx = 0.0;
        if (r < cnt && col < p.dh) {
            uint kb = row_base(b, p.sk, j0 + r, h) + col;
            kx = k[kb];
            if (with_v) vx = v[kb];
        }
        Ks[r * PAD + col / 4u][col % 4u] = kx;
        Vs[r * PAD + col / 4u][col % 4u] = vx;
    }
}

float score(vec4 qv[NC], uint jj, uint i, uint j, uint nc) {
    float dotp = 0.0;
    for (uint c = 0u; c < NC; ++c)
        if (c < nc) dotp += dot(qv[c], Ks[jj * PAD + c]);
    float sv = dotp * p.scale;
    if (p.has_mask != 0u) sv += mask[i * p.msi + j * p.msj];
    return sv;
}

void main() {
    uint row = gl_LocalInvocationID.x / LANES, lane = gl_LocalInvocationID.x % LANES;
    uint h = gl_WorkGroupID.y, b = gl_WorkGroupID.z;
    uint i = gl_WorkGroupID.x * ROWS + row;
    bool live = i < p.sq;
    uint nc = (p.dh + 3u) / 4u;

    vec4 qv[NC], gv[NC], acc[NC];
    uint qb = row_base(b, p.sq, live ? i : 0u, h);
    float drow = 0.0;
    for (uint c = 0u; c < NC; ++c) {
        qv[c] = vec4(0.0);
        gv[c] = vec4(0.0);
        acc[c] = vec4(0.0);
        for (uint e = 0u; e < 4u; ++e) {
            if (live && 4u * c + e < p.dh) {
                qv[c][e] = q[qb + 4u * c + e];
                gv[c][e] = g[qb + 4u * c + e];
                drow += gv[c][e] * o[qb + 4u * c + e];
            }
        }
    }

    // sweep 1: the row's log-sum-exp
    float m = NEG_INF, l = 0.0;
    for (uint j0 = 0u; j0 < p.sk; j0 += TILE) {
        uint cnt = min(uint(TILE), p.sk - j0);
        barrier();
        load_tile(b, h, j0, cnt, nc, false);
        barrier();
        if (!live) continue;
        for (uint x = 0u; x < PER_LANE; ++x) {
            uint jj = x * LANES + lane;
            if (jj < cnt) {
                float sv = score(qv, jj, i, j0 + jj, nc);
                float mnew = max(m, sv);
                float mref = mnew == NEG_INF ? 0.0 : mnew;
                l = l * exp(m - mref) + exp(sv - mref);
                m = mnew;
            }
        }
    }
    lanes_softmax(m, l, row, lane);
    float lse = m + log(l);  // -inf for a fully masked row: NaN below, as numpy

    // sweep 2: dq
    for (uint j0 = 0u; j0 < p.sk; j0 += TILE) {
        uint cnt = min(uint(TILE), p.sk - j0);
        barrier();
        load_tile(b, h, j0, cnt, nc, true);
        barrier();
        if (!live) continue;
        for (uint x = 0u; x < PER_LANE; ++x) {
            uint jj = x * LANES + lane;
            if (jj < cnt) {
                float pij = exp(score(qv, jj, i, j0 + jj, nc) - lse);
                float dp = 0.0;
                for (uint c = 0u; c < NC; ++c)
                    if (c < nc) dp += dot(gv[c], Vs[jj * PAD + c]);
                float ds = pij * (dp - drow);
                for (uint c = 0u; c < NC; ++c)
                    if (c < nc) acc[c] += ds * Ks[jj * PAD + c];
            }
        }
    }
    lanes_sum(acc, p.scale, nc, row, lane);
    if (!live) return;
    for (uint c = 0u; c < NC; ++c)
        if (c % LANES == lane)
            for (uint e = 0u; e < 4u; ++e)
                if (4u * c + e < p.dh) dq[qb + 4u * c + e] = acc[c][e];
    if (lane == 0u) {
        uint si = (b * gl_NumWorkGroups.y + h) * p.sq + i;
        stats[si] = lse;
        stats[p.nstat + si] = drow;
    }
}
