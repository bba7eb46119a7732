// Shared by flowgrad's compute shaders.
#ifndef FG_COMMON_GLSL
#define FG_COMMON_GLSL  // included by a shader and by a GLSL body it includes
//
// T is the storage type of float tensors: float, or float16_t when the shader
// is built with -DF16=1 (the `// variants: f32 f16` first line). Arithmetic is
// done in f32: read with LOAD(x), write with STORE(x).
#ifdef F16
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#define T float16_t
#define STORE(x) float16_t(x)
#else
#define T float
#define STORE(x) (x)
#endif
#define LOAD(x) float(x)

// A 1-D launch over n elements may use a 2-D grid (group counts are capped at
// 65535 per axis); the runtime's grid(n, local) picks the group counts, and
// this gives each invocation its flat index.
uint flat_index() {
    return gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
}

// max that returns NaN when either operand is NaN, as numpy's maximum does
// (GLSL's max may return either operand, so a NaN would vanish from a max
// reduction, a softmax or a loss, and a step would look finite).
float fg_nanmax(float a, float b) { return (isnan(a) || a > b) ? a : b; }
vec2 fg_nanmax(vec2 a, vec2 b) { return vec2(fg_nanmax(a.x, b.x), fg_nanmax(a.y, b.y)); }
float fg_nanmin(float a, float b) { return (isnan(a) || a < b) ? a : b; }
vec2 fg_nanmin(vec2 a, vec2 b) { return vec2(fg_nanmin(a.x, b.x), fg_nanmin(a.y, b.y)); }
#endif
