// What a GEMM's store may do to each output (lower/linalg.py's Epilogue
// describes it to every GEMM kernel the same way): add a residual R shaped
// and laid out as C and/or a bias over n, in the order the adds bits give
// (1 residual, 2 bias, 4 the bias before the residual), then end with an
// activation (EPI_ACT, a map op id; 0: none), storing the value before it
// in H (laid out as C) for the backward. Each result is rounded to the
// storage type as a separate dispatch would store it (fused_map.comp); a
// driver may fold such an f32 -> f16 -> f32 round trip (lavapipe does), which
// leaves the sum rounded once, an f16 ulp from the unfused plan's value.
// Needs fg_math.glsl and map_ops.glsl.
#ifndef FG_GEMM_EPILOGUE_GLSL
#define FG_GEMM_EPILOGUE_GLSL
// a specialization constant: a product without an activation compiles with none of its code
layout(constant_id = 0) const uint EPI_ACT = 0u;

// The activations the store offers (Pointwise.activation marks their ops),
// each the function map_apply.glsl computes for that op.
float epi_act(float v) {
    switch (EPI_ACT) {
    case M_GELU: return fg_gelu(v);
    case M_GELU_TANH: return fg_gelu_tanh(v);
    case M_RELU: return fg_relu(v);
    case M_SILU: return fg_silu(v);
    case M_TANH: return fg_tanh(v);
    case M_SIGMOID: return fg_sigmoid(v);
    }
    return fg_nan();
}
#endif
