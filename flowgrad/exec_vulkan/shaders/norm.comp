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
// `items` counts what the segments handle: rows, (chunk, column)s or columns.
#include "common.glsl"

#define FG_WG 256
layout(local_size_x = FG_WG) in;

#include "segment_reduce.glsl"

layout(std430, set = 0, binding = 0) readonly buffer X { T x[]; };
layout(std430, set = 0, binding = 1) readonly buffer W { T w[]; };
layout(std430, set = 0, binding = 2) readonly buffer B { T b[]; };
layout(std430, set = 0, binding = 3) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 4) writeonly buffer Y { T y[]; };     // y or dx
layout(std430, set = 0, binding = 5) writeonly buffer DW { T dw[]; };
layout(std430, set = 0, binding = 6) writeonly buffer DB { T db[]; };
layout(std430, set = 0, binding = 7) buffer Stats { float stats[]; };  // f32 [N, 2]
layout(std430, set = 0, binding = 8) buffer Part { float part[]; };    // f32 [chunks, D, 2]

layout(push_constant) uniform Push {
    uint items;
    uint N;      // rows of x
    uint D;      // row length
    uint S;
    uint mode;
    float eps;
    uint chunks;
} pc;

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

void rows(uint row, bool live, uint lane, uint S, uint mode, bool rms) {
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
    for (uint j = lane; j < pc.D; j += S) {
        precise float gw = float(g[start + j]) * float(w[j]);
        precise float xhat = (float(x[start + j]) - mean) * rstd;
        y[start + j] = T(rstd * ((gw - c) - xhat * acc.y));
    }
    if (lane == 0u) {
        stats[2u * row] = mean;
        stats[2u * row + 1u] = rstd;
    }
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
            float xhat = (float(x[i]) - stats[2u * r]) * stats[2u * r + 1u];
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
    bool rms = mode == 1u || mode == 3u || mode == 5u || mode == 7u;
    if (mode >= 6u) {  // one thread per column adds up the chunks' parts
        for (uint col = gl_GlobalInvocationID.x; col < pc.items; col += gl_NumWorkGroups.x * FG_WG) {
            vec2 acc = vec2(0.0);
            for (uint c = 0u; c < pc.chunks; ++c)
                acc += vec2(part[2u * (c * pc.D + col)], part[2u * (c * pc.D + col) + 1u]);
            dw[col] = T(acc.x);
            if (!rms) db[col] = T(acc.y);
        }
        return;
    }
    bool il = mode >= 4u;  // columns: consecutive threads take consecutive columns
    uint lane = fg_seg_lane(S, il);
    uint per_group = FG_WG / S;
    for (uint base = gl_WorkGroupID.x * per_group; base < pc.items;
         base += gl_NumWorkGroups.x * per_group) {
        uint item = base + fg_seg_slot(S, il);
        bool live = item < pc.items;
        if (mode < 4u) rows(item, live, lane, S, mode, rms);
        else columns(item, live, lane, S, rms);
    }
}
