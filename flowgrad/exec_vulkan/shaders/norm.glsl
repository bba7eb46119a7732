// layernorm and rmsnorm over the last axis (rows of D), forward and backward.
// Row modes (a segment of S lanes per row):
//   0 layernorm:      y = (x - mean) * rstd * w + b
//   1 rmsnorm:        y = x * rstd * w
//                     (rows of D <= MAXC_FWD * S: each row read once, into registers)
//   2 layernorm dx:   dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)),
//                     gw = g * w; also stats[2r] = mean, stats[2r+1] = rstd
//   3 rmsnorm dx:     dx = rstd * (gw - xhat * mean(gw * xhat)); stats as above
// Column modes (need stats; a segment per column and chunk of rows: item =
// chunk * D + j, the rows cut in `chunks` pieces so that few columns still
// fill the device):
//   4 layernorm:      dw[j] = sum_r g * xhat, db[j] = sum_r g
//   5 rmsnorm:        dw[j] = sum_r g * xhat
//                     (chunks > 1: the sums go to part[2 item], part[2 item + 1])
//   6 / 7             layernorm / rmsnorm: dw, db = the sums of the chunks' parts
// In 16-byte vectors (the norm_vec build, FG_VECTORS, which runs these alone; rows
// of D a multiple of VW, 8 halves or 4 f32 a load):
//   10 / 11           layernorm / rmsnorm forward: as modes 0 / 1, each row read
//                     once (D <= MAXV * VW * S)
//   12 / 13           the one-pass backward of modes 8 / 9 (D <= MAXC * S)
// One-pass backward (rows of D <= MAXC * S):
//   8 / 9             layernorm / rmsnorm: dx as in mode 2 / 3 (each row read
//                     once, into registers), while each lane sums g * xhat and
//                     g for its columns over the workgroup's rows; each workgroup leaves its column sums in part
//                     [group, D, 2], added up into dw and db by the last
//                     workgroups to finish (finish_columns: counters in stats,
//                     zero before the dispatch and reset by those workgroups;
//                     `chunks` is the groups per cluster there).
// `items` counts what the segments handle: rows, (chunk, column)s or columns.
// flags bit 1: dx is added to r (a gradient summed on its way: y = r + dx).
#extension GL_EXT_control_flow_attributes : require
#ifdef FG_SUBGROUP
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
// threads numbered subgroup by subgroup, so that a row's lanes are consecutive lanes of one
// subgroup (or whole subgroups) whatever order the device puts subgroups in
#define FG_LID (gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID)
#endif
#include "common.glsl"

#define FG_WG 256
layout(local_size_x = FG_WG) in;

#include "segment_reduce.glsl"

layout(std430, set = 0, binding = 0) readonly buffer X { T x[]; };
layout(std430, set = 0, binding = 1) readonly buffer W { T w[]; };
layout(std430, set = 0, binding = 2) readonly buffer B { T b[]; };
layout(std430, set = 0, binding = 3) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 4) buffer Y { T y[]; };               // y or dx
layout(std430, set = 0, binding = 5) writeonly buffer DW { T dw[]; };
layout(std430, set = 0, binding = 6) writeonly buffer DB { T db[]; };
layout(std430, set = 0, binding = 7) coherent buffer Stats { uint stats[]; };  // f32 bits [N, 2]; modes 8, 9: a counter
layout(std430, set = 0, binding = 8) coherent buffer Part { float part[]; };   // f32 [chunks or groups, D, 2]
layout(std430, set = 0, binding = 8) coherent readonly buffer Part2 { vec2 part2[]; };
layout(std430, set = 0, binding = 8) coherent readonly buffer Part4 { vec4 part4[]; };
layout(std430, set = 0, binding = 9) readonly buffer R { T r[]; };

#ifdef FG_VECTORS
// norm_vec runs modes 10-13: x, w, b, g, y and r as 16-byte vectors of VW elements
// (vectors.glsl). A lane's i-th column of a row (of MAXC) is element i % VW of its
// vector i / VW, the row's vector lane + (i / VW) * S.
#define ONE_PASS(mode) ((mode) >= 12u)
#define ROW_ONE_PASS row_one_pass_vectors
#define LANE_COL(lane, i, S) (((lane) + ((i) / VW) * (S)) * VW + (i) % VW)
#define FIRST_COL(i, S) LANE_COL(0u, i, S)   // lane 0's: the least of any lane's
#include "vectors.glsl"
layout(std430, set = 0, binding = 0) readonly buffer XV { VT xv[]; };
layout(std430, set = 0, binding = 1) readonly buffer WV { VT wv[]; };
layout(std430, set = 0, binding = 2) readonly buffer BV { VT bv[]; };
layout(std430, set = 0, binding = 3) readonly buffer GV { VT gv[]; };
layout(std430, set = 0, binding = 4) writeonly buffer YV { VT yv[]; };
layout(std430, set = 0, binding = 9) readonly buffer RV { VT rv[]; };
#else
#define ONE_PASS(mode) ((mode) >= 8u)
#define ROW_ONE_PASS row_one_pass
#define LANE_COL(lane, i, S) ((lane) + (i) * (S))
#define FIRST_COL(i, S) ((i) * (S))
#endif

layout(push_constant) uniform Push {
    uint items;
    uint N;      // rows of x
    uint D;      // row length
    uint S;
    uint mode;
    float eps;
    uint chunks;
    uint flags;
} pc;

#define MAXC 8       // columns per lane in the one-pass backward
#define MAXC_FWD 32  // columns per lane in the forward's row held in registers
#define MAXV 4       // vectors per lane in the vectorized forward
shared bool last_group;

shared vec4 seg4[FG_WG];

#ifdef FG_SUBGROUP
// A row's sum over its S lanes: shuffles within a subgroup (every lane gets the same
// sum: each step adds the same two values in either lane), then, for rows wider
// than a subgroup, the subgroups' sums in order through shared memory.
vec4 sg_sum4(vec4 v, uint S) {
    for (uint o = min(S, gl_SubgroupSize) >> 1; o > 0u; o >>= 1) v += subgroupShuffleXor(v, o);
    if (S <= gl_SubgroupSize) return v;
    if (gl_SubgroupInvocationID == 0u) seg4[gl_SubgroupID] = v;
    barrier();
    uint per = S / gl_SubgroupSize, first = FG_LID / S * per;
    vec4 r = vec4(0.0);
    for (uint q = first; q < first + per; ++q) r += seg4[q];
    barrier();
    return r;
}
#endif

// fg_seg_reduce2's sum, over vec4s (segments of consecutive lanes). Segments
// of up to 64 lanes: each lane adds its segment's partials up itself, in lane
// order (one barrier, not one per halving, and every lane the same sum).
vec4 seg_sum4(vec4 v, uint S) {
    if (S == 1u) return v;
#ifdef FG_SUBGROUP
    return sg_sum4(v, S);
#endif
    uint lid = FG_LID, lane = lid & (S - 1u);
    seg4[lid] = v;
    barrier();
    vec4 r;
    if (S <= 64u) {
        r = vec4(0.0);
        for (uint q = lid - lane; q < lid - lane + S; ++q) r += seg4[q];
    } else {
        for (uint s = S >> 1; s > 0u; s >>= 1) {
            if (lane < s) seg4[lid] += seg4[lid + s];
            barrier();
        }
        r = seg4[lid - lane];
    }
    barrier();
    return r;
}

// A row's sum over its segment of S consecutive lanes (every lane of the segment gets it).
vec2 row_sum2(vec2 v, uint S) {
#ifdef FG_SUBGROUP
    return S == 1u ? v : sg_sum4(vec4(v, 0.0, 0.0), S).xy;
#else
    return fg_seg_reduce2(v, S, 0u, false);
#endif
}

float row_sum(float v, uint S) { return row_sum2(vec2(v, 0.0), S).x; }

// mean and rstd of row `row` (mean 0 for rmsnorm), all lanes of a segment.
vec2 row_stats(uint start, bool live, uint lane, uint S, bool rms) {
    float mean = 0.0;
    if (!rms) {
        float s = 0.0;
        if (live)
            for (uint j = lane; j < pc.D; j += S) s += LOAD(x[start + j]);
        mean = row_sum(s, S) / float(pc.D);
    }
    float v = 0.0;
    if (live)
        for (uint j = lane; j < pc.D; j += S) {
            float d = LOAD(x[start + j]) - mean;
            v += d * d;
        }
    v = row_sum(v, S) / float(pc.D);
    return vec2(mean, inversesqrt(v + pc.eps));
}

// dx into y; added as the unfused step would: dx stored (rounded) first, then the sum
void store_dx(uint at, float dx) {
    y[at] = STORE((pc.flags & 2u) != 0u ? LOAD(r[at]) + LOAD(STORE(dx)) : dx);
}

// The forward of a row of D <= MAXC_FWD * S: the lane's columns read once, into
// registers (indexed at literal indices only), the mean and then the
// variance about it summed from them.
void row_in_registers(uint row, bool live, uint lane, uint S, bool rms) {
    uint start = row * pc.D;
    float xs[MAXC_FWD];
    float s = 0.0;
    [[unroll]] for (uint k = 0u; k < MAXC_FWD; ++k) {
        uint j = lane + k * S;
        xs[k] = live && j < pc.D ? LOAD(x[start + j]) : 0.0;
        s += xs[k];
    }
    float mean = rms ? 0.0 : seg_sum4(vec4(s, 0.0, 0.0, 0.0), S).x / float(pc.D);
    float v = 0.0;
    [[unroll]] for (uint k = 0u; k < MAXC_FWD; ++k) {
        float d = xs[k] - mean;
        if (lane + k * S < pc.D) v += d * d;
    }
    v = seg_sum4(vec4(v, 0.0, 0.0, 0.0), S).x / float(pc.D);
    if (!live) return;
    float rstd = inversesqrt(v + pc.eps);
    [[unroll]] for (uint k = 0u; k < MAXC_FWD; ++k) {
        uint j = lane + k * S;
        if (j < pc.D) {
            float y0 = (xs[k] - mean) * rstd * LOAD(w[j]);
            y[start + j] = STORE(rms ? y0 : y0 + LOAD(b[j]));
        }
    }
}

#ifdef FG_VECTORS
// The forward of modes 10, 11: row_in_registers' arithmetic, the row moved in
// vectors (lane + k * S is the lane's k-th vector of the row)
void row_vectors(uint row, bool live, uint lane, uint S, bool rms) {
    uint nv = pc.D / VW, start = row * nv;
    float xs[MAXV * VW];
    float s = 0.0;
    [[unroll]] for (uint k = 0u; k < MAXV; ++k) {
        uint v = lane + k * S;
        VT q = live && v < nv ? xv[start + v] : VT(0);
        [[unroll]] for (uint e = 0u; e < VW; ++e) {
            xs[k * VW + e] = vel(q, e);
            s += xs[k * VW + e];
        }
    }
    float mean = rms ? 0.0 : seg_sum4(vec4(s, 0.0, 0.0, 0.0), S).x / float(pc.D);
    float var = 0.0;
    [[unroll]] for (uint k = 0u; k < MAXV; ++k) {
        if (lane + k * S < nv) {
            [[unroll]] for (uint e = 0u; e < VW; ++e) {
                float d = xs[k * VW + e] - mean;
                var += d * d;
            }
        }
    }
    var = seg_sum4(vec4(var, 0.0, 0.0, 0.0), S).x / float(pc.D);
    if (!live) return;
    float rstd = inversesqrt(var + pc.eps);
    [[unroll]] for (uint k = 0u; k < MAXV; ++k) {
        uint v = lane + k * S;
        if (v < nv) {
            VT wq = wv[v], bq = rms ? VT(0) : bv[v];
            float o[VW];
            [[unroll]] for (uint e = 0u; e < VW; ++e) {
                float y0 = (xs[k * VW + e] - mean) * rstd * vel(wq, e);
                o[e] = rms ? y0 : y0 + vel(bq, e);
            }
            yv[start + v] = vpack(o);
        }
    }
}
#endif

void rows(uint row, bool live, uint lane, uint S, uint mode, bool rms) {
#ifdef FG_VECTORS
    if (mode >= 10u) {
        row_vectors(row, live, lane, S, rms);
        return;
    }
#endif
    if (mode < 2u && pc.D <= MAXC_FWD * S) {
        row_in_registers(row, live, lane, S, rms);
        return;
    }
    uint start = row * pc.D;
    vec2 st = row_stats(start, live, lane, S, rms);
    float mean = st.x, rstd = st.y;
    if (mode < 2u) {
        if (live)
            for (uint j = lane; j < pc.D; j += S) {
                float v = (LOAD(x[start + j]) - mean) * rstd * LOAD(w[j]);
                y[start + j] = STORE(rms ? v : v + LOAD(b[j]));
            }
        return;
    }
    vec2 acc = vec2(0.0);  // sum(gw), sum(gw * xhat)
    if (live)
        for (uint j = lane; j < pc.D; j += S) {
            // precise: the second loop must compute the very same gw and
            // xhat (no FMA contraction), or their mean no longer cancels
            precise float gw = LOAD(g[start + j]) * LOAD(w[j]);
            precise float xhat = (LOAD(x[start + j]) - mean) * rstd;
            acc += vec2(gw, gw * xhat);
        }
    acc = row_sum2(acc, S) / float(pc.D);
    if (!live) return;
    float c = rms ? 0.0 : acc.x;
    for (uint j = lane; j < pc.D; j += S) {
        precise float gw = LOAD(g[start + j]) * LOAD(w[j]);
        precise float xhat = (LOAD(x[start + j]) - mean) * rstd;
        store_dx(start + j, rstd * ((gw - c) - xhat * acc.y));
    }
    if (lane == 0u) {
        stats[2u * row] = floatBitsToUint(mean);
        stats[2u * row + 1u] = floatBitsToUint(rstd);
    }
}

// The one-pass backward's row statistics from the lane's columns xs, gs (s: its sum of xs):
// mean, then acc = (variance, mean(gw), mean(gw * d)) over the row, d = x - mean. A macro:
// row_one_pass and row_one_pass_vectors declare mean and acc with it
#define ROW_MOMENTS                                                                            \
    float mean = rms ? 0.0 : row_sum(s, S) / float(pc.D);                                     \
    vec4 acc = vec4(0.0);  /* sum(d * d), sum(gw), sum(gw * d) */                              \
    [[unroll]] for (uint k = 0u; k < MAXC; ++k) {                                             \
        if (LANE_COL(lane, k, S) < pc.D) {                                                    \
            float d = xs[k] - mean;                                                           \
            precise float gw = gs[k] * wk[k];                                                 \
            acc += vec4(d * d, gw, gw * d, 0.0);                                              \
        }                                                                                     \
    }                                                                                         \
    acc = seg_sum4(acc, S) / float(pc.D);

// The one-pass backward's row: the lane's MAXC columns held in registers
// (one read of x and g), two reductions (the mean; then the variance and
// the two sums dx needs, together), and the lane's column sums carried on.
// Registers are indexed at literal indices only (indexed at run time,
// NVIDIA keeps an array in local memory).
void row_one_pass(uint row, bool live, uint lane, uint S, bool rms, float wk[MAXC], inout vec2 cols[MAXC]) {
    uint start = row * pc.D;
    float xs[MAXC], gs[MAXC];
    float s = 0.0;
    [[unroll]] for (uint k = 0u; k < MAXC; ++k) {
        uint j = lane + k * S;
        bool in_row = live && j < pc.D;
        xs[k] = in_row ? LOAD(x[start + j]) : 0.0;
        gs[k] = in_row ? LOAD(g[start + j]) : 0.0;
        s += xs[k];
    }
    ROW_MOMENTS
    if (!live) return;
    float rstd = inversesqrt(acc.x + pc.eps);
    float c = rms ? 0.0 : acc.y, a = rstd * acc.z;   // mean(gw), mean(gw * xhat)
    [[unroll]] for (uint k = 0u; k < MAXC; ++k) {
        uint j = lane + k * S;
        if (j < pc.D) {
            precise float gw = gs[k] * wk[k];
            float xhat = (xs[k] - mean) * rstd;
            store_dx(start + j, rstd * ((gw - c) - xhat * a));
            cols[k] += vec2(gs[k] * xhat, gs[k]);
        }
    }
}

#ifdef FG_VECTORS
// row_one_pass in vectors (modes 12, 13): the lane's MAXC columns are MAXC / VW vectors
void row_one_pass_vectors(uint row, bool live, uint lane, uint S, bool rms, float wk[MAXC], inout vec2 cols[MAXC]) {
    uint nv = pc.D / VW, start = row * nv;
    float xs[MAXC], gs[MAXC];
    float s = 0.0;
    [[unroll]] for (uint k = 0u; k < MAXC / VW; ++k) {
        uint v = lane + k * S;
        bool in_row = live && v < nv;
        VT qx = in_row ? xv[start + v] : VT(0), qg = in_row ? gv[start + v] : VT(0);
        [[unroll]] for (uint e = 0u; e < VW; ++e) {
            xs[k * VW + e] = vel(qx, e);
            gs[k * VW + e] = vel(qg, e);
            s += xs[k * VW + e];
        }
    }
    ROW_MOMENTS
    if (!live) return;
    float rstd = inversesqrt(acc.x + pc.eps);
    float c = rms ? 0.0 : acc.y, a = rstd * acc.z;   // mean(gw), mean(gw * xhat)
    bool add = (pc.flags & 2u) != 0u;
    [[unroll]] for (uint k = 0u; k < MAXC / VW; ++k) {
        uint v = lane + k * S;
        if (v < nv) {
            VT qr = add ? rv[start + v] : VT(0);
            float o[VW];
            [[unroll]] for (uint e = 0u; e < VW; ++e) {
                uint i = k * VW + e;
                precise float gw = gs[i] * wk[i];
                float xhat = (xs[i] - mean) * rstd;
                float dx = rstd * ((gw - c) - xhat * a);
                o[e] = add ? vel(qr, e) + vround(dx) : dx;   // as store_dx: dx stored, then the sum
                cols[i] += vec2(gs[i] * xhat, gs[i]);
            }
            yv[start + v] = vpack(o);
        }
    }
}
#endif

// Parts first .. first + count - 1 of part ([slot, D, 2]) added up in slot
// order, into slot `to` or, when final, into dw (and db); two columns per
// 16-byte load (D even), 8 loads in flight.
void sum_parts(uint first, uint count, uint to, bool final, bool rms) {
    uint step = pc.D % 2u == 0u ? 2u : 1u;
    for (uint j = gl_LocalInvocationID.x * step; j < pc.D; j += FG_WG * step) {
        vec4 acc = vec4(0.0);   // (dw, db) of columns j and j + 1
        uint q = first, end = first + count;
        if (step == 2u) {
            for (; q + 8u <= end; q += 8u) {
                vec4 v[8];
                [[unroll]] for (uint u = 0u; u < 8u; ++u) v[u] = part4[((q + u) * pc.D + j) / 2u];
                [[unroll]] for (uint u = 0u; u < 8u; ++u) acc += v[u];
            }
            for (; q < end; ++q) acc += part4[(q * pc.D + j) / 2u];
        } else {
            for (; q < end; ++q) acc.xy += part2[q * pc.D + j];
        }
        for (uint u = 0u; u < step; ++u) {
            if (final) {
                dw[j + u] = STORE(acc[2u * u]);
                if (!rms) db[j + u] = STORE(acc[2u * u + 1u]);
            } else {
                part[2u * (to * pc.D + j + u)] = acc[2u * u];
                part[2u * (to * pc.D + j + u) + 1u] = acc[2u * u + 1u];
            }
        }
    }
}

// Whether this workgroup is the last of `count` to add one to counter i
// (after its stores are visible); the last resets the counter for the next run.
bool arrives_last(uint i, uint count) {
    memoryBarrierBuffer();
    barrier();
    if (gl_LocalInvocationID.x == 0u) {
        last_group = atomicAdd(stats[i], 1u) == count - 1u;
        if (last_group) stats[i] = 0u;
    }
    barrier();
    bool last = last_group;
    if (last) memoryBarrierBuffer();
    return last;
}

// modes 8, 9 after the rows: the workgroup's column sums into part slot
// (its group), then in two levels, so that no one workgroup reads them all:
// the last of each cluster of `chunks` groups adds the cluster's into slot
// groups + cluster, the last cluster to finish adds those into dw (and db).
// Counters: stats[0] the clusters done, stats[1 + c] cluster c's groups.
void finish_columns(vec2 cols[MAXC], uint lane, uint S, bool rms) {
    uint lid = FG_LID;
    uint per_group = FG_WG / S;
    uint base = gl_WorkGroupID.x * pc.D;
    [[unroll]] for (uint k = 0u; k < MAXC; ++k) {
        if (FIRST_COL(k, S) >= pc.D) break;
        fg_seg[lid] = cols[k];
        barrier();
        uint j = LANE_COL(lane, k, S);
        if (lid < S && j < pc.D) {
            vec2 sum = fg_seg[lid];
            for (uint q = 1u; q < per_group; ++q) sum += fg_seg[q * S + lid];
            part[2u * (base + j)] = sum.x;
            part[2u * (base + j) + 1u] = sum.y;
        }
        barrier();
    }
    uint groups = gl_NumWorkGroups.x, size = pc.chunks, cluster = gl_WorkGroupID.x / size;
    uint clusters = (groups + size - 1u) / size, first = cluster * size;
    uint members = min(size, groups - first);
    if (!arrives_last(1u + cluster, members)) return;
    sum_parts(first, members, groups + cluster, clusters == 1u, rms);
    if (clusters > 1u && arrives_last(0u, clusters)) sum_parts(groups, clusters, 0u, true, rms);
}

void columns(uint item, bool live, uint lane, uint S, bool rms) {
    uint chunk = item / pc.D;
    uint col = item - chunk * pc.D;
    uint piece = (pc.N + pc.chunks - 1u) / pc.chunks;
    uint end = min(pc.N, (chunk + 1u) * piece);
    vec2 acc = vec2(0.0);  // sum(g * xhat), sum(g)
    if (live)
        for (uint r = chunk * piece + lane; r < end; r += S) {
            uint i = r * pc.D + col;
            float gi = LOAD(g[i]);
            float xhat = (LOAD(x[i]) - uintBitsToFloat(stats[2u * r])) * uintBitsToFloat(stats[2u * r + 1u]);
            acc += vec2(gi * xhat, gi);
        }
    acc = fg_seg_reduce2(acc, S, 0u, true);
    if (!live || lane != 0u) return;
    if (pc.chunks > 1u) {
        part[2u * item] = acc.x;
        part[2u * item + 1u] = acc.y;
    } else {
        dw[col] = STORE(acc.x);
        if (!rms) db[col] = STORE(acc.y);
    }
}

void main() {
    uint S = pc.S;
    uint mode = pc.mode;
    bool rms = (mode & 1u) == 1u;
    if (mode == 6u || mode == 7u) {  // one thread per column adds up the chunks' parts
        for (uint col = gl_GlobalInvocationID.x; col < pc.items; col += gl_NumWorkGroups.x * FG_WG) {
            vec2 acc = vec2(0.0);
            for (uint c = 0u; c < pc.chunks; ++c)
                acc += vec2(part[2u * (c * pc.D + col)], part[2u * (c * pc.D + col) + 1u]);
            dw[col] = STORE(acc.x);
            if (!rms) db[col] = STORE(acc.y);
        }
        return;
    }
    bool il = mode == 4u || mode == 5u;  // columns: consecutive threads take consecutive columns
    uint lane = fg_seg_lane(S, il);
    uint per_group = FG_WG / S;
    vec2 cols[MAXC];
    float wk[MAXC];   // the one-pass backward's weights: a lane's columns are the same in every row
    [[unroll]] for (uint k = 0u; k < MAXC; ++k) {
        cols[k] = vec2(0.0);
        uint j = LANE_COL(lane, k, S);
        wk[k] = ONE_PASS(mode) && j < pc.D ? LOAD(w[j]) : 0.0;
    }
    for (uint base = gl_WorkGroupID.x * per_group; base < pc.items;
         base += gl_NumWorkGroups.x * per_group) {
        uint item = base + fg_seg_slot(S, il);
        bool live = item < pc.items;
        if (il) columns(item, live, lane, S, rms);
        else if ONE_PASS(mode) ROW_ONE_PASS(item, live, lane, S, rms, wk, cols);
        else rows(item, live, lane, S, mode, rms);
    }
    if ONE_PASS(mode) finish_columns(cols, lane, S, rms);
}
