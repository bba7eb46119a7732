// variants: f32 f16
#version 450
// layernorm and rmsnorm over the last axis (rows of D), forward and backward.
// Row modes (a segment of S lanes per row):
//   0 layernorm:      y = (x - mean) * rstd * w + b
//   1 rmsnorm:        y = x * rstd * w
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
// One-pass backward (rows of D <= MAXC * S):
//   8 / 9             layernorm / rmsnorm: dx as in mode 2 / 3, while each lane
//                     sums g * xhat and g for its columns over the workgroup's
//                     rows; each workgroup leaves its column sums in part
//                     [group, D, 2], and the last workgroup to finish (a
//                     counter in stats[0], zero before the dispatch and reset
//                     by that workgroup) adds them up into dw and db.
// `items` counts what the segments handle: rows, (chunk, column)s or columns.
// flags bit 0: dx is added to what y holds (a gradient accumulated in place).
#extension GL_EXT_control_flow_attributes : require
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

#define MAXC 8  // columns per lane in the one-pass backward
shared bool last_group;

// mean and rstd of row `row` (mean 0 for rmsnorm), all lanes of a segment.
vec2 row_stats(uint start, bool live, uint lane, uint S, bool rms) {
    float mean = 0.0;
    if (!rms) {
        float s = 0.0;
        if (live)
            for (uint j = lane; j < pc.D; j += S) s += float(x[start + j]);
        mean = fg_seg_sum(s, S, false) / float(pc.D);
    }
    float v = 0.0;
    if (live)
        for (uint j = lane; j < pc.D; j += S) {
            float d = float(x[start + j]) - mean;
            v += d * d;
        }
    v = fg_seg_sum(v, S, false) / float(pc.D);
    return vec2(mean, inversesqrt(v + pc.eps));
}

// dx at column j of the row at `start`; returns (g * xhat, g) for the column sums
vec2 dx_at(uint start, uint j, float mean, float rstd, float c, float a) {
    float gi = float(g[start + j]);
    precise float gw = gi * float(w[j]);
    precise float xhat = (float(x[start + j]) - mean) * rstd;
    float dx = rstd * ((gw - c) - xhat * a);
    // added as the unfused step would: dx stored (rounded) first, then the sum
    y[start + j] = T((pc.flags & 1u) != 0u ? float(y[start + j]) + float(T(dx)) : dx);
    return vec2(gi * xhat, gi);
}

void rows(uint row, bool live, uint lane, uint S, uint mode, bool rms, inout vec2 cols[MAXC]) {
    uint start = row * pc.D;
    vec2 st = row_stats(start, live, lane, S, rms);
    float mean = st.x, rstd = st.y;
    if (mode < 2u) {
        if (live)
            for (uint j = lane; j < pc.D; j += S) {
                float v = (float(x[start + j]) - mean) * rstd * float(w[j]);
                y[start + j] = T(rms ? v : v + float(b[j]));
            }
        return;
    }
    vec2 acc = vec2(0.0);  // sum(gw), sum(gw * xhat)
    if (live)
        for (uint j = lane; j < pc.D; j += S) {
            // precise: the second loop must compute the very same gw and
            // xhat (no FMA contraction), or their mean no longer cancels
            precise float gw = float(g[start + j]) * float(w[j]);
            precise float xhat = (float(x[start + j]) - mean) * rstd;
            acc += vec2(gw, gw * xhat);
        }
    acc = fg_seg_reduce2(acc, S, 0u, false) / float(pc.D);
    if (!live) return;
    float c = rms ? 0.0 : acc.x;
    // the first MAXC columns of the lane unrolled, so cols is indexed at literal
    // indices (indexed at run time, NVIDIA keeps it in local memory)
    [[unroll]] for (uint k = 0u; k < MAXC; ++k) {
        uint j = lane + k * S;
        if (j < pc.D) {
            vec2 col = dx_at(start, j, mean, rstd, c, acc.y);
            if (mode >= 8u) cols[k] += col;
        }
    }
    for (uint j = lane + MAXC * S; j < pc.D; j += S) dx_at(start, j, mean, rstd, c, acc.y);
    if (lane == 0u && mode < 8u) {
        stats[2u * row] = floatBitsToUint(mean);
        stats[2u * row + 1u] = floatBitsToUint(rstd);
    }
}

// modes 8, 9 after the rows: the workgroup's column sums into part, then
// the last workgroup adds every workgroup's sums into dw (and db).
void finish_columns(vec2 cols[MAXC], uint lane, uint S, bool rms) {
    uint lid = gl_LocalInvocationID.x;
    uint per_group = FG_WG / S;
    uint base = gl_WorkGroupID.x * pc.D;
    [[unroll]] for (uint k = 0u; k < MAXC; ++k) {
        if (k * S >= pc.D) break;
        fg_seg[lid] = cols[k];
        barrier();
        uint j = lane + k * S;
        if (lid < S && j < pc.D) {
            vec2 sum = fg_seg[lid];
            for (uint q = 1u; q < per_group; ++q) sum += fg_seg[q * S + lid];
            part[2u * (base + j)] = sum.x;
            part[2u * (base + j) + 1u] = sum.y;
        }
        barrier();
    }
    memoryBarrierBuffer();
    barrier();
    if (lid == 0u) last_group = atomicAdd(stats[0], 1u) == gl_NumWorkGroups.x - 1u;
    barrier();
    if (!last_group) return;
    memoryBarrierBuffer();
    // one workgroup reads every group's sums: 8 loads in flight, added in group order
    uint groups = gl_NumWorkGroups.x;
    for (uint j = lid; j < pc.D; j += FG_WG) {
        vec2 acc = vec2(0.0);
        uint q = 0u;
        for (; q + 8u <= groups; q += 8u) {
            vec2 v[8];
            [[unroll]] for (uint u = 0u; u < 8u; ++u) v[u] = part2[(q + u) * pc.D + j];
            [[unroll]] for (uint u = 0u; u < 8u; ++u) acc += v[u];
        }
        for (; q < groups; ++q) acc += part2[q * pc.D + j];
        dw[j] = T(acc.x);
        if (!rms) db[j] = T(acc.y);
    }
    if (lid == 0u) stats[0] = 0u;   // ready for the next replay
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
            float gi = float(g[i]);
            float xhat = (float(x[i]) - uintBitsToFloat(stats[2u * r])) * uintBitsToFloat(stats[2u * r + 1u]);
            acc += vec2(gi * xhat, gi);
        }
    acc = fg_seg_reduce2(acc, S, 0u, true);
    if (!live || lane != 0u) return;
    if (pc.chunks > 1u) {
        part[2u * item] = acc.x;
        part[2u * item + 1u] = acc.y;
    } else {
        dw[col] = T(acc.x);
        if (!rms) db[col] = T(acc.y);
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
            dw[col] = T(acc.x);
            if (!rms) db[col] = T(acc.y);
        }
        return;
    }
    bool il = mode == 4u || mode == 5u;  // columns: consecutive threads take consecutive columns
    uint lane = fg_seg_lane(S, il);
    uint per_group = FG_WG / S;
    vec2 cols[MAXC];
    [[unroll]] for (uint k = 0u; k < MAXC; ++k) cols[k] = vec2(0.0);
    for (uint base = gl_WorkGroupID.x * per_group; base < pc.items;
         base += gl_NumWorkGroups.x * per_group) {
        uint item = base + fg_seg_slot(S, il);
        bool live = item < pc.items;
        if (il) columns(item, live, lane, S, rms);
        else rows(item, live, lane, S, mode, rms, cols);
    }
    if (mode >= 8u) finish_columns(cols, lane, S, rms);
}
