// The map ops, on values: y = MAP_op(a, b, c) with the op's scalar `param`.
// map_reduce.comp runs one per element (a, b, c read from its three inputs);
// fused_map.comp runs a short list of them per element, on registers. The
// M_* ids come from the Python table through the generated map_ops.glsl.
float map_apply(uint op, float a, float b, float c, float param) {
    switch (op) {
    case M_COPY: return a;
    case M_ADD: return a + b;
    case M_SUB: return a - b;
    case M_MUL: return a * b;
    case M_DIV: return a / b;
    case M_NEG: return -a;
    case M_EXP: return exp(a);
    case M_LOG: return log(a);
    case M_SQRT: return sqrt(a);
    case M_TANH: return fg_tanh(a);
    case M_SIGMOID: return fg_sigmoid(a);
    case M_RELU: return fg_relu(a);
    case M_GELU: return fg_gelu(a);
    case M_GELU_TANH: return fg_gelu_tanh(a);
    case M_SILU: return fg_silu(a);
    case M_POW: return fg_pow(a, param);
    case M_SQDIFF: { float d = a - b; return d * d; }
    case M_EQ: return a == b ? 1.0 : 0.0;
    case M_NE: return a != b ? 1.0 : 0.0;
    case M_LT: return a < b ? 1.0 : 0.0;
    case M_LE: return a <= b ? 1.0 : 0.0;
    case M_GT: return a > b ? 1.0 : 0.0;
    case M_GE: return a >= b ? 1.0 : 0.0;
    case M_DIV_DB: return -a * (b / c) / c;  // b = a, c = b of the division
    case M_EXP_B: return a * c;
    case M_LOG_B: return a / b;
    case M_SQRT_B: return a * 0.5 / c;
    case M_TANH_B: { float t = c; return a * (1.0 - t * t); }
    case M_SIGMOID_B: { float s = c; return a * s * (1.0 - s); }
    case M_RELU_B: return b <= 0.0 ? 0.0 : a;   // a NaN x passes g, as torch's threshold
    case M_GELU_B: return a * fg_gelu_grad(b);
    case M_GELU_TANH_B: return a * fg_gelu_tanh_grad(b);
    case M_SILU_B: {
        float x = b;
        float s = fg_sigmoid(x);
        return a * s * (1.0 + x * (1.0 - s));
    }
    case M_POW_B: return param == 0.0 ? 0.0 : a * param * fg_pow(b, param - 1.0);  // d/dx x^0 = 0, at 0 too
    case M_EXTREME_B: {   // torch.amax's (amin's) share * (x == max), a = share = g / count
        if (isnan(c)) return fg_nan();   // a NaN max equals nothing: count 0, the whole slice NaN
        return b == c ? a : (isinf(a) || isnan(a) ? fg_nan() : 0.0);   // 0 * a non-finite share
    }
    case M_DIFF_MUL: return c * (a - b);
    case M_ABS: return abs(a);
    // 0 at a NaN x, as torch.sgn: GLSL leaves sign(NaN) undefined
    case M_ABS_B: return a * (b > 0.0 ? 1.0 : (b < 0.0 ? -1.0 : 0.0));
    case M_MAXIMUM: return fg_nanmax(a, b);
    case M_MINIMUM: return fg_nanmin(a, b);
    // as torch.maximum / minimum: g unless this operand loses (where either is NaN, neither
    // does), half of it at a tie; a loser gets 0 even from a NaN g
    case M_MAXIMUM_DA: { float s = b, o = c; return s < o ? 0.0 : (s == o ? 0.5 * a : a); }
    case M_MINIMUM_DA: { float s = b, o = c; return s > o ? 0.0 : (s == o ? 0.5 * a : a); }
    case M_WHERE: return a != 0.0 ? b : c;
    case M_WHERE_DA: return b != 0.0 ? a : 0.0;
    case M_WHERE_DB: return b != 0.0 ? 0.0 : a;
    case M_CLAMP_MIN: return fg_nanmax(a, param);
    case M_CLAMP_MIN_B: return b >= param ? a : 0.0;
    case M_CLAMP_MAX: return fg_nanmin(a, param);
    case M_CLAMP_MAX_B: return b <= param ? a : 0.0;
    case M_LSE_EXP: return exp(a - (isinf(b) ? 0.0 : b));
    case M_LSE_LOG: return log(a) + param + (isinf(b) ? 0.0 : b);
    case M_LSE_B: return a * exp(b - c);
    case M_SIN: return fg_sincos(a).x;
    case M_COS: return fg_sincos(a).y;
    case M_SIN_B: return a * fg_sincos(b).y;
    case M_COS_B: return -a * fg_sincos(b).x;
    case M_SOFTSIGN: return a / (1.0 + abs(a));
    case M_ERF: return fg_erf(a);
    case M_PARAM: return param;
    }
    return fg_nan();
}
