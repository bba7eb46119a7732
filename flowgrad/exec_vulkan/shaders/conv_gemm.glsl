// Convolution as implicit GEMM on matmul_tiled.glsl's register tiles or
// matmul_coop.glsl's cooperative matrices: this file supplies the GEMM's
// operands (GEMM_OPERANDS), gathered from the image on the fly, so im2col
// patches never exist in memory. NCHW input x [N, C, H, W], output
// y [N, O, OH, OW], weight w [O, C/G, KH, KW]; the GEMM's batch z is the
// group, or with split-K (chunks > 1, mode 2 only) chunk * G + group: chunk
// c sums K from c * kc, at most kc deep, into its own partial weight
// gradient (c's [O, C/G*KH*KW] block of a [chunks, ...] scratch), which the
// host then sums. Per group:
//   mode 0, y  = x * w:   M = N*OH*OW,  cols = O/G,          K = (C/G)*KH*KW
//   mode 1, dx = g * w^T: M = N*H*W,    cols = C/G,          K = (O/G)*KH*KW
//   mode 2, dw = g^T * x: M = O/G,      cols = (C/G)*KH*KW,  K = N*OH*OW
// Mode 1 gathers, for each input pixel, the output pixels whose windows
// cover it (a tap whose offset the stride does not divide reads zero), so
// every output element is written by exactly one thread: no atomics.
// The bias (has_bias) is added to column z*cols + col in every mode (mode 1
// is the forward of a transposed convolution). Loads are scalar gathers:
// modes 0 and 1 walk pixels along M (contiguous in the image), mode 2
// along K; B runs along K in every mode.
#define GEMM_OPERANDS
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

layout(std430, set = 0, binding = 0) readonly buffer BufA { T a[]; };     // mode 0: x, 1 and 2: g
layout(std430, set = 0, binding = 1) readonly buffer BufB { T b[]; };     // mode 0 and 1: w, 2: x
layout(std430, set = 0, binding = 2) readonly buffer BufBias { T bias[]; };
layout(std430, set = 0, binding = 3) writeonly buffer BufC { T c[]; };
layout(push_constant, std430) uniform Push {
    uint N, C, H, W;
    uint O, OH, OW;
    uint KH, KW, SH, SW, PH, PW, DH, DW;
    uint G, mode, has_bias;
    uint chunks, kc;      // split-K: chunk count (1: no split) and depth
} p;

uint conv_m() { return p.mode == 0u ? p.N * p.OH * p.OW : p.mode == 1u ? p.N * p.H * p.W : p.O / p.G; }
uint conv_n() { uint cg = p.C / p.G; return p.mode == 0u ? p.O / p.G : p.mode == 1u ? cg : cg * p.KH * p.KW; }
uint conv_kfull() {
    uint kk = p.KH * p.KW;
    return p.mode == 0u ? (p.C / p.G) * kk : p.mode == 1u ? (p.O / p.G) * kk : p.N * p.OH * p.OW;
}
uint conv_k() { return p.chunks > 1u ? p.kc : conv_kfull(); }

#define GEMM_M conv_m()
#define GEMM_N conv_n()
#define GEMM_K conv_k()
#define GEMM_NZ (p.G * p.chunks)
#define GEMM_R 1u
#define GEMM_KEND(z) (p.chunks > 1u ? min(p.kc, conv_kfull() - ((z) / p.G) * p.kc) : conv_kfull())
#define A_KFAST (p.mode == 2u)
#define B_NFAST false
#define A_VEC false
#define B_VEC false
#define C_VEC false
#define A_BASE(z, r) (z)
#define B_BASE(z, r) (z)

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
    uint i = ((n * p.C + ch) * p.H + ih) * p.W + iw;
    return p.mode == 0u ? LOAD(a[i]) : LOAD(b[i]);
}

float g_at(uint n, uint ch, uint oh, uint ow) {
    return LOAD(a[((n * p.O + ch) * p.OH + oh) * p.OW + ow]);
}

// A(m, k) of batch z (group z % G; k counts from its chunk's start)
float a_at(uint z, uint m, uint k) {
    k += (z / p.G) * p.kc;
    z %= p.G;
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

// B(k, col) of batch z
float b_at(uint z, uint k, uint col) {
    k += (z / p.G) * p.kc;
    z %= p.G;
    uint kk = p.KH * p.KW, cg = p.C / p.G, og = p.O / p.G;
    if (p.mode == 0u)
        return LOAD(b[(z * og + col) * cg * kk + k]);
    if (p.mode == 1u)
        return LOAD(b[((z * og + k / kk) * cg + col) * kk + k % kk]);
    uint ohw = p.OH * p.OW;
    uint n = k / ohw, q = k % ohw, t = col % kk, ih, iw;
    if (tap_input(q / p.OW, q % p.OW, t / p.KW, t % p.KW, ih, iw))
        return x_at(n, z * cg + col / kk, ih, iw);
    return 0.0;
}

// Runs: GEMM_RUN consecutive elements of an operand along its load order
// (A: along M in modes 0 and 1, along K in mode 2; B: along K), each zero
// outside the product. The GEMM kernels load through these (GEMM_RUNS):
// one run divides its start into pixel and tap once and steps the rest,
// where GEMM_RUN calls of a_at / b_at would divide each.
#ifndef GEMM_RUN
#define GEMM_RUN 4          // matmul_tiled.glsl's register vectors; matmul_coop.glsl's builds ask for 8
#endif
#define GEMM_RUNS

// flat pixel index i over [batch, rows, cols], as (n, y, x); advance() steps it without dividing
struct Pixel { uint n, y, x; };
Pixel pixel_at(uint i, uint rows, uint cols) {
    uint hw = rows * cols, q = i % hw;
    return Pixel(i / hw, q / cols, q % cols);
}
void advance(inout Pixel px, uint rows, uint cols) {
    if (++px.x == cols) {
        px.x = 0u;
        if (++px.y == rows) { px.y = 0u; ++px.n; }
    }
}

// A from (m, k) of batch z (k from its chunk's start)
void a_run(uint z, uint m, uint k, uint kend, out float v[GEMM_RUN]) {
    uint mlim = conv_m(), kg = k + (z / p.G) * p.kc;
    z %= p.G;
    uint kk = p.KH * p.KW, og = p.O / p.G;
    if (p.mode == 2u) {
        Pixel px = pixel_at(kg, p.OH, p.OW);
        [[unroll]] for (uint j = 0u; j < GEMM_RUN; ++j) {
            v[j] = 0.0;
            if (m < mlim && k + j < kend) v[j] = g_at(px.n, z * og + m, px.y, px.x);
            advance(px, p.OH, p.OW);
        }
        return;
    }
    uint t = kg % kk, r = t / p.KW, s = t % p.KW, ch = kg / kk;
    bool live = k < kend;
    if (p.mode == 0u) {
        uint cg = p.C / p.G;
        Pixel px = pixel_at(m, p.OH, p.OW);
        [[unroll]] for (uint j = 0u; j < GEMM_RUN; ++j) {
            uint ih, iw;
            v[j] = 0.0;
            if (live && m + j < mlim && tap_input(px.y, px.x, r, s, ih, iw)) v[j] = x_at(px.n, z * cg + ch, ih, iw);
            advance(px, p.OH, p.OW);
        }
        return;
    }
    Pixel px = pixel_at(m, p.H, p.W);
    [[unroll]] for (uint j = 0u; j < GEMM_RUN; ++j) {
        uint oh, ow;
        v[j] = 0.0;
        if (live && m + j < mlim && tap_output(px.y, px.x, r, s, oh, ow)) v[j] = g_at(px.n, z * og + ch, oh, ow);
        advance(px, p.H, p.W);
    }
}

// B from (k, col) of batch z
void b_run(uint z, uint k, uint col, uint kend, out float v[GEMM_RUN]) {
    uint kg = k + (z / p.G) * p.kc;
    z %= p.G;
    uint kk = p.KH * p.KW, cg = p.C / p.G, og = p.O / p.G;
    bool live = col < conv_n();
    if (p.mode == 0u) {
        uint at = (z * og + col) * cg * kk + kg;
        [[unroll]] for (uint j = 0u; j < GEMM_RUN; ++j) {
            v[j] = 0.0;
            if (live && k + j < kend) v[j] = LOAD(b[at + j]);
        }
        return;
    }
    if (p.mode == 1u) {
        uint q = kg / kk, t = kg % kk;
        [[unroll]] for (uint j = 0u; j < GEMM_RUN; ++j) {
            v[j] = 0.0;
            if (live && k + j < kend) v[j] = LOAD(b[((z * og + q) * cg + col) * kk + t]);
            if (++t == kk) { t = 0u; ++q; }
        }
        return;
    }
    uint t = col % kk, r = t / p.KW, s = t % p.KW, ch = z * cg + col / kk;
    Pixel px = pixel_at(kg, p.OH, p.OW);
    [[unroll]] for (uint j = 0u; j < GEMM_RUN; ++j) {
        uint ih, iw;
        v[j] = 0.0;
        if (live && k + j < kend && tap_input(px.y, px.x, r, s, ih, iw)) v[j] = x_at(px.n, ch, ih, iw);
        advance(px, p.OH, p.OW);
    }
}

// never called: the *_VEC switches are off (gathered operands have no vector form)
vec4 a_vec(uint base, uint m, uint k) { return vec4(0.0); }
vec4 b_vec(uint base, uint k, uint n) { return vec4(0.0); }
void store_c4(uint z, uint m, uint n, vec4 v) {}

void store_c(uint z, uint m, uint col, float v) {
    uint cg = p.C / p.G, og = p.O / p.G, chunk = z / p.G;
    z %= p.G;
    if (p.has_bias != 0u) v += LOAD(bias[z * conv_n() + col]);
    uint at;
    if (p.mode == 0u) {
        uint ohw = p.OH * p.OW;
        at = ((m / ohw) * p.O + z * og + col) * ohw + m % ohw;
    } else if (p.mode == 1u) {
        uint hw = p.H * p.W;
        at = ((m / hw) * p.C + z * cg + col) * hw + m % hw;
    } else {
        at = ((chunk * p.O + z * og + m) * cg) * p.KH * p.KW + col;
    }
    c[at] = STORE(v);
}
