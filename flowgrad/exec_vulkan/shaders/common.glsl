// Shared by flowgrad's compute shaders.
#ifndef FG_COMMON_GLSL
#define FG_COMMON_GLSL  // included by a shader and by a GLSL body it includes
//
// T is the storage type of float tensors: float, float16_t when the shader
// is built with -DF16=1 (the `// variants: f32 f16` first line), or bf16 with
// -DBF16=1 (`bf16`: the top 16 bits of an f32, held as uint16_t, so any device
// with 16-bit storage runs it). Arithmetic is done in f32: read with LOAD(x),
// write with STORE(x) (never float(x) or T(x), which would convert bf16's bits
// as an integer; the build compiles each bf16 shader once more with T a
// struct, -DBF16_LINT, so that such a conversion fails it). T4 is T's
// 4-vector, read with LOAD4 and written with STORE4.
#if defined(BF16)
#extension GL_EXT_shader_16bit_storage : require
// f32 -> bf16 bits: round to nearest, ties to even (as PyTorch); an inf stays
// inf, a NaN stays a NaN (quiet), past bf16's largest is inf
uint fg_bf16(float f) {
    uint u = floatBitsToUint(f);
    return isnan(f) ? ((u >> 16) | 0x40u) : ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
uvec4 fg_bf16(vec4 f) { return uvec4(fg_bf16(f.x), fg_bf16(f.y), fg_bf16(f.z), fg_bf16(f.w)); }
#ifdef BF16_LINT
#extension GL_EXT_shader_explicit_arithmetic_types_int16 : require
struct fg_bf16_t { uint16_t bits; };
struct fg_bf16x4_t { u16vec4 bits; };
#define T fg_bf16_t
#define T4 fg_bf16x4_t
#define LOAD(x) uintBitsToFloat(uint((x).bits) << 16)
#define STORE(x) fg_bf16_t(uint16_t(fg_bf16(float(x))))
#define LOAD4(x) uintBitsToFloat(uvec4((x).bits) << 16)
#define STORE4(x) fg_bf16x4_t(u16vec4(fg_bf16(vec4(x))))
#else
#define T uint16_t
#define T4 u16vec4
#define LOAD(x) uintBitsToFloat(uint(x) << 16)
#define STORE(x) uint16_t(fg_bf16(float(x)))
#define LOAD4(x) uintBitsToFloat(uvec4(x) << 16)
#define STORE4(x) u16vec4(fg_bf16(vec4(x)))
#endif
#elif defined(F16)
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#define T float16_t
#define T4 f16vec4
#define STORE(x) float16_t(x)
#define LOAD(x) float(x)
#define LOAD4(x) vec4(x)
#define STORE4(x) f16vec4(x)
#else
#define T float
#define T4 vec4
#define STORE(x) float(x)
#define LOAD(x) float(x)
#define LOAD4(x) vec4(x)
#define STORE4(x) vec4(x)
#endif

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
