// Storage type T for shaders built in two variants (`// variants: f32 f16`):
// the f16 build (-DF16=1) stores float16_t and every shader computes in f32.
#ifdef F16
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#define T float16_t
#else
#define T float
#endif
