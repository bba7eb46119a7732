// the cooperative-matrix GEMMs' epilogue buffers: its residual, bias and pre-activation value
// (gemm_epilogue.glsl), in the operands' type H
layout(std430, set = 0, binding = 3) readonly buffer BufR { H res[]; };
layout(std430, set = 0, binding = 4) readonly buffer BufBias { H bias[]; };
layout(std430, set = 0, binding = 5) writeonly buffer BufH { H pre[]; };
