// Flash-attention backward, pass 2 of 2 (f32): the LANES threads of a key
// row j split the query rows, streamed (q, g, and the lse_i / D_i saved by
// pass 1) through shared memory:
//   dv_j = sum_i p_ij g_i,   dk_j = scale * sum_i ds_ij q_i
// The lanes' shares merge in shared memory; each workgroup writes only its
// own rows of dk and dv: no atomics.
#include "attn_common.glsl"

layout(std430, set = 0, binding = 0) readonly buffer Q { float q[]; };
layout(std430, set = 0, binding = 1) readonly buffer K { float k[]; };
layout(std430, set = 0, binding = 2) readonly buffer V { float v[]; };
layout(std430, set = 0, binding = 3) readonly buffer G { float g[]; };
layout(std430, set = 0, binding = 4) readonly buffer Mask { float mask[]; };
layout(std430, set = 0, binding = 5) readonly buffer Stats { float stats[]; };
layout(std430, set = 0, binding = 6) writeonly buffer DK { float dk[]; };
layout(std430, set = 0, binding = 7) writeonly buffer DV { float dv[]; };

shared vec4 Qs[TILE * PAD];
shared vec4 Gs[TILE * PAD];
shared float Ls[TILE];
shared float Ds[TILE];

void main() {
    uint row = gl_LocalInvocationID.x / LANES, lane = gl_LocalInvocationID.x % LANES;
    uint h = gl_WorkGroupID.y, b = gl_WorkGroupID.z;
    uint j = gl_WorkGroupID.x * ROWS + row;
    bool live = j < p.sk;
    uint nc = (p.dh + 3u) / 4u;

    vec4 kv[NC], vv[NC], dka[NC], dva[NC];
    uint kb = row_base(b, p.sk, live ? j : 0u, h);
    for (uint c = 0u; c < NC; ++c) {
        kv[c] = vec4(0.0);
        vv[c] = vec4(0.0);
        dka[c] = vec4(0.0);
        dva[c] = vec4(0.0);
        for (uint e = 0u; e < 4u; ++e) {
            if (live && 4u * c + e < p.dh) {
                kv[c][e] = k[kb + 4u * c + e];
                vv[c][e] = v[kb + 4u * c + e];
            }
        }
    }

    uint sbase = (b * gl_NumWorkGroups.y + h) * p.sq;
    for (uint i0 = 0u; i0 < p.sq; i0 += TILE) {
        uint cnt = min(uint(TILE), p.sq - i0);
        barrier();
        for (uint e = gl_LocalInvocationID.x; e < TILE * 4u * nc; e += ROWS * LANES) {
            uint r = e / (4u * nc), col = e % (4u * nc);
            float qx = 0.0, gx = 0.0;
            if (r < cnt && col < p.dh) {
                uint qb = row_base(b, p.sq, i0 + r, h) + col;
                qx = q[qb];
                gx = g[qb];
            }
            Qs[r * PAD + col / 4u][col % 4u] = qx;
            Gs[r * PAD + col / 4u][col % 4u] = gx;
        }
        for (uint r = gl_LocalInvocationID.x; r < TILE; r += ROWS * LANES) {
            float lv = 0.0, dvv = 0.0;
            if (r < cnt) {
                lv = stats[sbase + i0 + r];
                dvv = stats[p.nstat + sbase + i0 + r];
            }
            Ls[r] = lv;
            Ds[r] = dvv;
        }
        barrier();
        if (!live) continue;
        for (uint x = 0u; x < PER_LANE; ++x) {
            uint ii = x * LANES + lane;
            if (ii < cnt) {
                float dotp = 0.0, dp = 0.0;
                for (uint c = 0u; c < NC; ++c) {
                    if (c < nc) {
                        dotp += dot(Qs[ii * PAD + c], kv[c]);
                        dp += dot(Gs[ii * PAD + c], vv[c]);
                    }
                }
                float sv = dotp * p.scale;
                if (p.has_mask != 0u) sv += mask[(i0 + ii) * p.msi + j * p.msj];
                float pij = exp(sv - Ls[ii]);
                float ds = pij * (dp - Ds[ii]);
                for (uint c = 0u; c < NC; ++c) {
                    if (c < nc) {
                        dva[c] += pij * Gs[ii * PAD + c];
                        dka[c] += ds * Qs[ii * PAD + c];
                    }
                }
            }
        }
    }
    lanes_sum(dka, p.scale, nc, row, lane);
    lanes_sum(dva, 1.0, nc, row, lane);
    if (!live) return;
    for (uint c = 0u; c < NC; ++c) {
        if (c % LANES == lane) {
            for (uint e = 0u; e < 4u; ++e) {
                if (4u * c + e < p.dh) {
                    dk[kb + 4u * c + e] = dka[c][e];
                    dv[kb + 4u * c + e] = dva[c][e];
                }
            }
        }
    }
}
