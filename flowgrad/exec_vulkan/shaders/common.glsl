// Shared by flowgrad's compute shaders.
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
