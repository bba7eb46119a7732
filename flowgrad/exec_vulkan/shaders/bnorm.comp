// variants: f32 f16 bf16
#version 450
// batchnorm and groupnorm on x [N, C, S] (S: the pixels of a channel).
// Statistics are taken per segment: batchnorm's segment is a channel (all N
// x S of its elements), groupnorm's one group of one example (C/G x S
// contiguous elements). Segment k's element j is
//   x[(j / inner) * outer_stride + k * seg_stride + j % inner],
// and element i belongs to segment (i / inner) % segments and to channel
// (i / S) % C (the affine weight and bias).
// Modes (one workgroup per segment or channel, or one invocation per element):
//   0 segment statistics -> stats[k] = (mean, rstd); with running statistics
//     (flags bit 0) an evaluation step (rng[0] == 0) takes them from rm, rv,
//     and a training step with flags bit 1 also updates rm, rv in place
//   1 y = (x - mean) * rstd * w + b
//   2 segment sums of dxhat = g * w and of dxhat * xhat -> stats[k].zw
//   3 channel sums: out[c] = sum g * xhat (dw), db[c] = sum g
//   4 dx from stats (an evaluation step: dxhat * rstd)
// flags bit 2: the running statistics are f32 beside f16 data (dtype="mixed"
// keeps them f32, as AMP keeps batch norm's buffers: an f16 running variance
// near 1 cannot move by less than half its ulp, 4.9e-4, so small updates vanish).
#include "common.glsl"

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) readonly buffer BufX { T x[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufG { T g[]; };
layout(std430, set = 0, binding = 2) readonly buffer BufW { T w[]; };
layout(std430, set = 0, binding = 3) readonly buffer BufB { T b[]; };
layout(std430, set = 0, binding = 4) buffer BufRM { T rm[]; };
layout(std430, set = 0, binding = 4) buffer BufRM32 { float rm32[]; };
layout(std430, set = 0, binding = 5) buffer BufRV { T rv[]; };
layout(std430, set = 0, binding = 5) buffer BufRV32 { float rv32[]; };
layout(std430, set = 0, binding = 6) readonly buffer BufRng { uint rng[]; };
layout(std430, set = 0, binding = 7) buffer BufStats { vec4 stats[]; };
layout(std430, set = 0, binding = 8) writeonly buffer BufOut { T o[]; };
layout(std430, set = 0, binding = 9) writeonly buffer BufDB { T db[]; };
layout(push_constant, std430) uniform Push {
    uint N, C, S, inner, segments, seg_len, outer_stride, seg_stride;
    uint mode, flags;
    float eps, momentum;
} p;

shared float red[256];

float wg_sum(float v) {
    uint lid = gl_LocalInvocationID.x;
    red[lid] = v;
    barrier();
    for (uint s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) red[lid] += red[lid + s];
        barrier();
    }
    float r = red[0];
    barrier();
    return r;
}

uint seg_index(uint k, uint j) { return (j / p.inner) * p.outer_stride + k * p.seg_stride + j % p.inner; }
uint channel_of(uint i) { return (i / p.S) % p.C; }
uint segment_of(uint i) { return (i / p.inner) % p.segments; }
bool running_eval() { return (p.flags & 1u) != 0u && rng[0] == 0u; }
bool stats_f32() { return (p.flags & 4u) != 0u; }
float rm_at(uint k) { return stats_f32() ? rm32[k] : LOAD(rm[k]); }
float rv_at(uint k) { return stats_f32() ? rv32[k] : LOAD(rv[k]); }
float xhat_at(uint i) { vec4 s = stats[segment_of(i)]; return (LOAD(x[i]) - s.x) * s.y; }

void segment_stats(uint k) {
    uint lid = gl_LocalInvocationID.x;
    if (running_eval()) {
        if (lid == 0u) stats[k] = vec4(rm_at(k), inversesqrt(rv_at(k) + p.eps), 0.0, 0.0);
        return;
    }
    float acc = 0.0;
    for (uint j = lid; j < p.seg_len; j += 256u) acc += LOAD(x[seg_index(k, j)]);
    float mean = wg_sum(acc) / float(p.seg_len);
    acc = 0.0;
    for (uint j = lid; j < p.seg_len; j += 256u) {
        float d = LOAD(x[seg_index(k, j)]) - mean;
        acc += d * d;
    }
    float var = wg_sum(acc) / float(p.seg_len);
    if (lid == 0u) {
        stats[k] = vec4(mean, inversesqrt(var + p.eps), 0.0, 0.0);
        if ((p.flags & 3u) == 3u && rng[0] != 0u) {
            float n = float(p.seg_len);
            float unbiased = p.seg_len > 1u ? var * n / (n - 1.0) : var;
            float m = (1.0 - p.momentum) * rm_at(k) + p.momentum * mean;
            float v = (1.0 - p.momentum) * rv_at(k) + p.momentum * unbiased;
            if (stats_f32()) {
                rm32[k] = m;
                rv32[k] = v;
            } else {
                rm[k] = STORE(m);
                rv[k] = STORE(v);
            }
        }
    }
}

void segment_sums(uint k) {
    uint lid = gl_LocalInvocationID.x;
    float a = 0.0, c = 0.0;
    for (uint j = lid; j < p.seg_len; j += 256u) {
        uint i = seg_index(k, j);
        float d = LOAD(g[i]) * LOAD(w[channel_of(i)]);
        a += d;
        c += d * xhat_at(i);
    }
    a = wg_sum(a);
    c = wg_sum(c);
    if (lid == 0u) stats[k].zw = vec2(a, c);
}

void channel_sums(uint ch) {
    uint lid = gl_LocalInvocationID.x;
    float a = 0.0, c = 0.0;
    for (uint j = lid; j < p.N * p.S; j += 256u) {
        uint i = (j / p.S) * p.C * p.S + ch * p.S + j % p.S;
        float gv = LOAD(g[i]);
        a += gv * xhat_at(i);
        c += gv;
    }
    a = wg_sum(a);
    c = wg_sum(c);
    if (lid == 0u) {
        o[ch] = STORE(a);
        db[ch] = STORE(c);
    }
}

void main() {
    uint total = p.N * p.C * p.S;
    if (p.mode == 0u || p.mode == 2u || p.mode == 3u) {
        uint count = p.mode == 3u ? p.C : p.segments;
        for (uint k = gl_WorkGroupID.x; k < count; k += gl_NumWorkGroups.x) {
            if (p.mode == 0u) segment_stats(k);
            else if (p.mode == 2u) segment_sums(k);
            else channel_sums(k);
        }
        return;
    }
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < total; i += step) {
        uint ch = channel_of(i);
        if (p.mode == 1u) {
            o[i] = STORE(xhat_at(i) * LOAD(w[ch]) + LOAD(b[ch]));
        } else {
            vec4 s = stats[segment_of(i)];
            float d = LOAD(g[i]) * LOAD(w[ch]);
            float v = running_eval() ? d * s.y
                : s.y * (d - s.z / float(p.seg_len) - xhat_at(i) * s.w / float(p.seg_len));
            o[i] = STORE(v);
        }
    }
}
