// variants: f32 f16
#version 450
// Convolution as implicit GEMM: matmul.comp's 64x64 shared-memory tiles,
// with the operand tiles gathered from the image on the fly (im2col patches
// never exist in memory). NCHW input x [N, C, H, W], output y [N, O, OH, OW],
// weight w [O, C/G, KH, KW]; workgroup z is the group. Per group:
//   mode 0, y  = x * w:   M = N*OH*OW,  cols = O/G,          K = (C/G)*KH*KW
//   mode 1, dx = g * w^T: M = N*H*W,    cols = C/G,          K = (O/G)*KH*KW
//   mode 2, dw = g^T * x: M = O/G,      cols = (C/G)*KH*KW,  K = N*OH*OW
// Mode 1 gathers, for each input pixel, the output pixels whose windows
// cover it (a tap whose offset the stride does not divide reads zero), so
// every output element is written by exactly one thread: no atomics.
// The bias (has_bias) is added to column z*cols + col in every mode (mode 1
// is the forward of a transposed convolution).
#include "common.glsl"
#define BM 64
#define BN 64
#define BK 16

layout(local_size_x = 16, local_size_y = 16) in;
layout(std430, set = 0, binding = 0) readonly buffer BufA { T a[]; };     // mode 0: x, 1 and 2: g
layout(std430, set = 0, binding = 1) readonly buffer BufB { T b[]; };     // mode 0 and 1: w, 2: x
layout(std430, set = 0, binding = 2) readonly buffer BufBias { T bias[]; };
layout(std430, set = 0, binding = 3) writeonly buffer BufC { T c[]; };
layout(push_constant, std430) uniform Push {
    uint N, C, H, W;
    uint O, OH, OW;
    uint KH, KW, SH, SW, PH, PW, DH, DW;
    uint G, mode, has_bias;
} p;

shared float As[BK][BM + 1];
shared float Bs[BK][BN + 1];

// the input pixel a tap of an output pixel reads; false in the padding
bool tap_input(uint oh, uint ow, uint r, uint s, out uint ih, out uint iw) {
    int h = int(oh * p.SH + r * p.DH) - int(p.PH);
    int w = int(ow * p.SW + s * p.DW) - int(p.PW);
    ih = uint(h);
    iw = uint(w);
    return h >= 0 && w >= 0 && h < int(p.H) && w < int(p.W);
}

// the output pixel whose tap (r, s) reads input pixel (ih, iw); false if none
bool tap_output(uint ih, uint iw, uint r, uint s, out uint oh, out uint ow) {
    int h = int(ih + p.PH) - int(r * p.DH);
    int w = int(iw + p.PW) - int(s * p.DW);
    if (h < 0 || w < 0 || h % int(p.SH) != 0 || w % int(p.SW) != 0) return false;
    oh = uint(h) / p.SH;
    ow = uint(w) / p.SW;
    return oh < p.OH && ow < p.OW;
}

float x_at(uint n, uint ch, uint ih, uint iw) {
    return float(p.mode == 0u ? a[((n * p.C + ch) * p.H + ih) * p.W + iw] : b[((n * p.C + ch) * p.H + ih) * p.W + iw]);
}

float g_at(uint n, uint ch, uint oh, uint ow) {
    return float(a[((n * p.O + ch) * p.OH + oh) * p.OW + ow]);
}

// A(m, k) of group z
float load_a(uint z, uint m, uint k) {
    uint kk = p.KH * p.KW;
    if (p.mode == 0u) {
        uint ohw = p.OH * p.OW, cg = p.C / p.G;
        uint n = m / ohw, q = m % ohw, t = k % kk, ih, iw;
        if (tap_input(q / p.OW, q % p.OW, t / p.KW, t % p.KW, ih, iw))
            return x_at(n, z * cg + k / kk, ih, iw);
        return 0.0;
    }
    if (p.mode == 1u) {
        uint hw = p.H * p.W, og = p.O / p.G;
        uint n = m / hw, q = m % hw, t = k % kk, oh, ow;
        if (tap_output(q / p.W, q % p.W, t / p.KW, t % p.KW, oh, ow))
            return g_at(n, z * og + k / kk, oh, ow);
        return 0.0;
    }
    uint ohw = p.OH * p.OW, og = p.O / p.G;
    uint n = k / ohw, q = k % ohw;
    return g_at(n, z * og + m, q / p.OW, q % p.OW);
}

// B(k, col) of group z
float load_b(uint z, uint k, uint col) {
    uint kk = p.KH * p.KW, cg = p.C / p.G, og = p.O / p.G;
    if (p.mode == 0u)
        return float(b[(z * og + col) * cg * kk + k]);
    if (p.mode == 1u)
        return float(b[((z * og + k / kk) * cg + col) * kk + k % kk]);
    uint ohw = p.OH * p.OW;
    uint n = k / ohw, q = k % ohw, t = col % kk, ih, iw;
    if (tap_input(q / p.OW, q % p.OW, t / p.KW, t % p.KW, ih, iw))
        return x_at(n, z * cg + col / kk, ih, iw);
    return 0.0;
}

uint c_index(uint z, uint m, uint col) {
    uint cg = p.C / p.G, og = p.O / p.G;
    if (p.mode == 0u) {
        uint ohw = p.OH * p.OW;
        return ((m / ohw) * p.O + z * og + col) * ohw + m % ohw;
    }
    if (p.mode == 1u) {
        uint hw = p.H * p.W;
        return ((m / hw) * p.C + z * cg + col) * hw + m % hw;
    }
    return (z * og + m) * cg * p.KH * p.KW + col;
}

void main() {
    uint kk = p.KH * p.KW, cg = p.C / p.G, og = p.O / p.G;
    uint M = p.mode == 0u ? p.N * p.OH * p.OW : p.mode == 1u ? p.N * p.H * p.W : og;
    uint NC = p.mode == 0u ? og : p.mode == 1u ? cg : cg * kk;
    uint K = p.mode == 0u ? cg * kk : p.mode == 1u ? og * kk : p.N * p.OH * p.OW;
    // modes 0 and 1 walk pixels along M (contiguous in the image), mode 2 along K
    bool a_mfast = p.mode != 2u;
    uint tx = gl_LocalInvocationID.x, ty = gl_LocalInvocationID.y;
    uint tid = ty * 16u + tx;
    uint z = gl_WorkGroupID.z;
    uint m0 = gl_WorkGroupID.y * BM, n0 = gl_WorkGroupID.x * BN;
    float acc[4][4];
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0;
    for (uint k0 = 0u; k0 < K; k0 += BK) {
        for (uint e = 0u; e < 4u; ++e) {
            uint l = tid + e * 256u;
            uint mm = a_mfast ? l % BM : l / BK;
            uint ka = a_mfast ? l / BM : l % BK;
            As[ka][mm] = (m0 + mm < M && k0 + ka < K) ? load_a(z, m0 + mm, k0 + ka) : 0.0;
            uint nn = l / BK, kb = l % BK;
            Bs[kb][nn] = (n0 + nn < NC && k0 + kb < K) ? load_b(z, k0 + kb, n0 + nn) : 0.0;
        }
        barrier();
        for (uint q = 0u; q < BK; ++q) {
            float av[4], bv[4];
            for (int i = 0; i < 4; ++i) av[i] = As[q][ty + 16u * uint(i)];
            for (int j = 0; j < 4; ++j) bv[j] = Bs[q][tx + 16u * uint(j)];
            for (int i = 0; i < 4; ++i)
                for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
        }
        barrier();
    }
    for (int i = 0; i < 4; ++i) {
        uint m = m0 + ty + 16u * uint(i);
        if (m >= M) continue;
        for (int j = 0; j < 4; ++j) {
            uint col = n0 + tx + 16u * uint(j);
            if (col >= NC) continue;
            float v = acc[i][j];
            if (p.has_bias != 0u) v += float(bias[z * NC + col]);
            c[c_index(z, m, col)] = STORE(v);
        }
    }
}
