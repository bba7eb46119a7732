// Accurate f32 math the GLSL builtins lack (erf, erfc) or give no error bound
// for over the whole range (tanh overflows to inf/inf on some drivers).
// Shared by the elementwise kernels (map_reduce.comp).

const float FG_SQRT1_2 = 0.70710678118654752;
const float FG_INV_SQRT_2PI = 0.39894228040143268;
const float FG_SQRT_2_OVER_PI = 0.79788456080286536;
const float FG_GELU_C = 0.044715;

float fg_nan() { return uintBitsToFloat(0x7fc00000u); }
float fg_inf() { return uintBitsToFloat(0x7f800000u); }
// GLSL has neither log1p nor expm1, and a GPU's log and exp are too coarse
// near 1 for Kahan's corrections: short series instead.
// log(1 + y) for 0 <= y <= 1 (softplus's e^-|x|) as 2 atanh(y / (2 + y)): an
// odd series in z <= 1/3 without cancellation, where log(1.0 + y) loses every
// digit of y below 1's rounding.
float fg_log1p01(float y) {
    float z = y / (2.0 + y), z2 = z * z;
    float s = 1.0 / 15.0;
    s = s * z2 + 1.0 / 13.0;
    s = s * z2 + 1.0 / 11.0;
    s = s * z2 + 1.0 / 9.0;
    s = s * z2 + 1.0 / 7.0;
    s = s * z2 + 1.0 / 5.0;
    s = s * z2 + 1.0 / 3.0;
    return 2.0 * z * (s * z2 + 1.0);
}
// e^x - 1: Taylor's series to x^9 for |x| < 1/2 (the next term is below f32's
// rounding there), e^x - 1 beyond.
float fg_expm1(float x) {
    if (abs(x) >= 0.5) return exp(x) - 1.0;
    float s = 1.0 + x / 9.0;
    s = 1.0 + x / 8.0 * s;
    s = 1.0 + x / 7.0 * s;
    s = 1.0 + x / 6.0 * s;
    s = 1.0 + x / 5.0 * s;
    s = 1.0 + x / 4.0 * s;
    s = 1.0 + x / 3.0 * s;
    s = 1.0 + x / 2.0 * s;
    return x * s;
}

// erf: rational fit x*P(x^2)/Q(x^2) on [-4, 4] (the one XLA uses for f32);
// max error 4.2e-7 absolute and relative (Abramowitz-Stegun 7.1.26 is 1.5e-7
// only in absolute terms and loses all relative accuracy near 0).
float fg_erf(float x) {
    if (isnan(x)) return x;   // clamp may turn a NaN into a bound
    x = clamp(x, -4.0, 4.0);
    float x2 = x * x;
    float p = -2.72614225801306e-10;
    p = p * x2 + 2.77068142495902e-08;
    p = p * x2 - 2.10102402082508e-06;
    p = p * x2 - 5.69250639462346e-05;
    p = p * x2 - 7.34990630326855e-04;
    p = p * x2 - 2.95459980854025e-03;
    p = p * x2 - 1.60960333262415e-02;
    float q = -1.45660718464996e-05;
    q = q * x2 - 2.13374055278905e-04;
    q = q * x2 - 1.68282697438203e-03;
    q = q * x2 - 7.37332916720468e-03;
    q = q * x2 - 1.42647390514189e-02;
    return x * p / q;
}

// erfc for z >= 0 (Numerical Recipes' Chebyshev fit, relative error < 1.2e-7
// in exact arithmetic, < 1e-5 in f32 out to z = 9): keeps RELATIVE accuracy
// in the tail, where 1 - erf(z) would cancel to nothing.
float fg_erfc_pos(float z) {
    float t = 1.0 / (1.0 + 0.5 * z);
    float p = 0.17087277;
    p = p * t - 0.82215223;
    p = p * t + 1.48851587;
    p = p * t - 1.13520398;
    p = p * t + 0.27886807;
    p = p * t - 0.18628806;
    p = p * t + 0.09678418;
    p = p * t + 0.37409196;
    p = p * t + 1.00002368;
    p = p * t - 1.26551223;
    return t * exp(p - z * z);
}

// Standard normal CDF, accurate in both tails.
float fg_phi(float x) {
    float e = 0.5 * fg_erfc_pos(abs(x) * FG_SQRT1_2);
    return x >= 0.0 ? 1.0 - e : e;
}

#ifdef FG_VECTORS
// fused_map_vec reads the sign and the size these functions branch on as bits, the form its
// f16 and bf16 builds were checked in on NVIDIA's driver 580.159 (whose f32 build computes
// x0 * x1 + x2 * x3 then tanh or sigmoid wrongly with float compares and bits alike, and is
// not used there). The same results, but tanh(-0) = -0.
#define FG_NEGATIVE(x) ((floatBitsToUint(x) & 0x80000000u) != 0u)
#define FG_NONNEGATIVE(x) ((floatBitsToUint(x) & 0x80000000u) == 0u)   // NaN: either way
#define FG_SMALL(a) (floatBitsToUint(a) < 0x3E000000u)   // 0 <= a < 0.125; NaN: false
#else
#define FG_NEGATIVE(x) ((x) < 0.0)
#define FG_NONNEGATIVE(x) ((x) >= 0.0)
#define FG_SMALL(a) ((a) < 0.125)
#endif

float fg_tanh(float x) {
    float a = abs(x);
    float r;
    if (FG_SMALL(a)) {
        // series: (1 - t)/(1 + t) below would lose relative accuracy here
        float a2 = a * a;
        r = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))));
    } else {
        float t = exp(-2.0 * a);  // <= 1: never overflows
        r = (1.0 - t) / (1.0 + t);
    }
    return FG_NEGATIVE(x) ? -r : r;
}

float fg_sigmoid(float x) {
    float e = exp(-abs(x));  // <= 1: never overflows
    return FG_NONNEGATIVE(x) ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

float fg_silu(float x) { return x * fg_sigmoid(x); }

float fg_relu(float x) { return (x > 0.0 || isnan(x)) ? x : 0.0; }   // NaN stays NaN, as numpy's maximum

float fg_gelu(float x) { return x * fg_phi(x); }

// d gelu / dx = Phi(x) + x phi(x)
float fg_gelu_grad(float x) { return fg_phi(x) + x * exp(-0.5 * x * x) * FG_INV_SQRT_2PI; }

float fg_gelu_tanh(float x) {
    float u = FG_SQRT_2_OVER_PI * (x + FG_GELU_C * x * x * x);
    return 0.5 * x * (1.0 + fg_tanh(u));
}

// x^p as torch.pow, where GLSL's pow is undefined (x < 0, x == 0, NaN, inf):
// exponents 0.5 and -0.5 are sqrt(x) and 1 / sqrt(x) (-0.0 gives -0.0 and
// -inf, -inf gives NaN), others C's pow; integer exponents up to 64 by
// repeated squaring, exact for small ones.
float fg_pow(float x, float p) {
    if (p == 0.0) return 1.0;
    if (p == 0.5) return sqrt(x);
    if (p == -0.5) return 1.0 / sqrt(x);
    if (isnan(x)) return x;
    bool integer = p == floor(p);
    if (integer && abs(p) <= 64.0) {
        int n = int(abs(p));
        float b = x, r = 1.0;
        while (n > 0) {
            if ((n & 1) != 0) r *= b;
            b *= b;
            n >>= 1;
        }
        return p < 0.0 ? 1.0 / r : r;
    }
    if (x < 0.0 && !isinf(x) && !integer) return fg_nan();
    // |x|^p, negated for a negative x (-0.0 too) and an odd p
    float a = abs(x);
    float r = isinf(a) ? (p > 0.0 ? fg_inf() : 0.0) : a == 0.0 ? (p > 0.0 ? 0.0 : fg_inf()) : pow(a, p);
    bool odd = integer && fract(0.5 * p) != 0.0;
    return odd && (floatBitsToUint(x) >> 31) != 0u ? -r : r;
}

// (sin x, cos x). GLSL's sin and cos promise only 2^-11 absolute error, and
// only inside [-pi, pi]; positional encodings take arguments in the
// thousands. So: x = j pi/2 + r with pi/2 in three parts (Cody-Waite: j times
// the first two is exact for |j| < 2^16), then Cephes' sinf / cosf
// polynomials on |r| <= pi/4, and the quadrant j mod 4 picks and signs them.
// Absolute error about 1e-7 for |x| < 1e4 and 1e-6 at 1e5; past that j pi/2
// is no longer exact and the error grows with |x|.
vec2 fg_sincos(float x) {
    if (isinf(x)) return vec2(fg_nan());
    float j = round(x * 0.636619772367581343);
    float r = ((x - j * 1.5703125) - j * 4.837512969970703125e-4) - j * 7.54978995489188216e-8;
    float z = r * r;
    float s = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4));
    float c = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5));
    float q = j - 4.0 * floor(j * 0.25);
    vec2 sc = (q == 0.0) ? vec2(s, c) : (q == 1.0) ? vec2(c, -s) : (q == 2.0) ? vec2(-s, -c) : vec2(-c, s);
    return sc;
}
