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
    case M_GELU_GRAD: return fg_gelu_grad(a);
    case M_SILU: return fg_silu(a);
    case M_POW: return fg_pow(a, param);
    case M_SQDIFF: { float d = a - b; return d * d; }
    case M_EQ: return a == b ? 1.0 : 0.0;
    case M_NE: return a != b ? 1.0 : 0.0;
    case M_LT: return a < b ? 1.0 : 0.0;
    case M_LE: return a <= b ? 1.0 : 0.0;
    case M_GT: return a > b ? 1.0 : 0.0;
    case M_GE: return a >= b ? 1.0 : 0.0;
    case M_ABS: return abs(a);
    case M_MAXIMUM: return fg_nanmax(a, b);
    case M_MINIMUM: return fg_nanmin(a, b);
    case M_WHERE: return a != 0.0 ? b : c;
    case M_CLAMP_MIN: return fg_nanmax(a, param);
    case M_CLAMP_MAX: return fg_nanmin(a, param);
    case M_LSE_EXP: return exp(a - (isinf(b) ? 0.0 : b));
    case M_LSE_LOG: return log(a) + param + (isinf(b) ? 0.0 : b);
    case M_SIN: return fg_sincos(a).x;
    case M_COS: return fg_sincos(a).y;
    case M_SOFTSIGN: return a / (1.0 + abs(a));
    case M_ERF: return fg_erf(a);
    case M_PARAM: return param;
    }
    return fg_nan();
}
