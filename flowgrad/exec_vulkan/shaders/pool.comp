// variants: f32 f16 bf16
#version 450
// 2-D pooling over planes of x [planes, H, W] into [planes, OH, OW].
// Forward modes: one invocation per output; backward modes: one per input
// pixel, gathering the gradient of every window that covers it (no atomics).
//   0 max forward, 1 max backward (gradient to each window's first maximum),
//   2 avg forward, 3 avg backward, 4 adaptive avg forward, 5 adaptive backward,
//   6 max pick (one invocation per output: g, shaped as x, at the window's first maximum of x).
#include "common.glsl"

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) readonly buffer BufX { T x[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufG { T g[]; };
layout(std430, set = 0, binding = 2) writeonly buffer BufOut { T o[]; };
layout(push_constant, std430) uniform Push {
    uint items, H, W, OH, OW;
    uint KH, KW, SH, SW, PH, PW;
    uint mode, include_pad;
} p;

// first (row-major) maximum of window (oh, ow) of plane base, as a flat pixel index; as
// PyTorch's max_pool2d, a NaN beats everything (so it propagates; the last NaN wins) and a
// window of -inf picks its first real pixel
uint argmax_of(uint base, uint oh, uint ow) {
    float best = 0.0;
    uint at = 0xFFFFFFFFu;
    for (uint r = 0u; r < p.KH; ++r) {
        int h = int(oh * p.SH + r) - int(p.PH);
        if (h < 0 || h >= int(p.H)) continue;
        for (uint s = 0u; s < p.KW; ++s) {
            int w = int(ow * p.SW + s) - int(p.PW);
            if (w < 0 || w >= int(p.W)) continue;
            uint idx = uint(h) * p.W + uint(w);
            float v = LOAD(x[base + idx]);
            if (at == 0xFFFFFFFFu || v > best || isnan(v)) { best = v; at = idx; }
        }
    }
    return at;
}

float divisor(uint oh, uint ow) {
    if (p.include_pad != 0u) return float(p.KH * p.KW);
    int h0 = int(oh * p.SH) - int(p.PH), w0 = int(ow * p.SW) - int(p.PW);
    int hn = min(h0 + int(p.KH), int(p.H)) - max(h0, 0);
    int wn = min(w0 + int(p.KW), int(p.W)) - max(w0, 0);
    return float(hn * wn);
}

// the windows along one axis that cover pixel i: [lo, hi]
void covering(uint i, uint pad, uint k, uint stride, uint n_out, out int lo, out int hi) {
    int first = int(i + pad) - int(k) + 1;
    lo = first <= 0 ? 0 : (first + int(stride) - 1) / int(stride);
    hi = min(int(n_out) - 1, int(i + pad) / int(stride));
}

// adaptive bins along one axis: [i n / out, ceil((i + 1) n / out))
uint bin_lo(uint i, uint n, uint out_n) { return i * n / out_n; }
uint bin_hi(uint i, uint n, uint out_n) { return ((i + 1u) * n + out_n - 1u) / out_n; }

float forward(uint i) {
    uint ohw = p.OH * p.OW, plane = i / ohw, oh = (i % ohw) / p.OW, ow = i % p.OW;
    uint base = plane * p.H * p.W;
    if (p.mode == 0u) return LOAD(x[base + argmax_of(base, oh, ow)]);
    if (p.mode == 6u) return LOAD(g[base + argmax_of(base, oh, ow)]);
    uint h0, h1, w0, w1;
    if (p.mode == 2u) {
        int hs = int(oh * p.SH) - int(p.PH), ws = int(ow * p.SW) - int(p.PW);
        h0 = uint(max(hs, 0)); h1 = uint(min(hs + int(p.KH), int(p.H)));
        w0 = uint(max(ws, 0)); w1 = uint(min(ws + int(p.KW), int(p.W)));
    } else {
        h0 = bin_lo(oh, p.H, p.OH); h1 = bin_hi(oh, p.H, p.OH);
        w0 = bin_lo(ow, p.W, p.OW); w1 = bin_hi(ow, p.W, p.OW);
    }
    float acc = 0.0;
    for (uint h = h0; h < h1; ++h)
        for (uint w = w0; w < w1; ++w) acc += LOAD(x[base + h * p.W + w]);
    return acc / (p.mode == 2u ? divisor(oh, ow) : float((h1 - h0) * (w1 - w0)));
}

float backward(uint i) {
    uint hw = p.H * p.W, plane = i / hw, ih = (i % hw) / p.W, iw = i % p.W;
    uint gbase = plane * p.OH * p.OW;
    float acc = 0.0;
    if (p.mode == 5u) {
        // bins covering ih lie within one of ih * OH / H
        int c0 = int(ih * p.OH / p.H), d0 = int(iw * p.OW / p.W);
        for (int oh = max(c0 - 1, 0); oh <= min(c0 + 1 + int(p.OH / p.H), int(p.OH) - 1); ++oh) {
            uint h0 = bin_lo(uint(oh), p.H, p.OH), h1 = bin_hi(uint(oh), p.H, p.OH);
            if (ih < h0 || ih >= h1) continue;
            for (int ow = max(d0 - 1, 0); ow <= min(d0 + 1 + int(p.OW / p.W), int(p.OW) - 1); ++ow) {
                uint w0 = bin_lo(uint(ow), p.W, p.OW), w1 = bin_hi(uint(ow), p.W, p.OW);
                if (iw < w0 || iw >= w1) continue;
                acc += LOAD(g[gbase + uint(oh) * p.OW + uint(ow)]) / float((h1 - h0) * (w1 - w0));
            }
        }
        return acc;
    }
    int hlo, hhi, wlo, whi;
    covering(ih, p.PH, p.KH, p.SH, p.OH, hlo, hhi);
    covering(iw, p.PW, p.KW, p.SW, p.OW, wlo, whi);
    uint me = ih * p.W + iw, base = plane * hw;
    for (int oh = hlo; oh <= hhi; ++oh)
        for (int ow = wlo; ow <= whi; ++ow) {
            float gv = LOAD(g[gbase + uint(oh) * p.OW + uint(ow)]);
            if (p.mode == 1u) {
                if (argmax_of(base, uint(oh), uint(ow)) == me) acc += gv;
            } else {
                acc += gv / divisor(uint(oh), uint(ow));
            }
        }
    return acc;
}

void main() {
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    bool fwd = p.mode == 0u || p.mode == 2u || p.mode == 4u || p.mode == 6u;
    for (uint i = gl_GlobalInvocationID.x; i < p.items; i += step)
        o[i] = STORE(fwd ? forward(i) : backward(i));
}
