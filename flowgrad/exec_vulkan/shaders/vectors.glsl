// Tensors moved in 16-byte vectors (VT) of VW elements of the storage type T:
// 8 halves (f16, or bf16's bits) or 4 f32. vel(v, e) is element e of vector v
// as f32, vpack rounds VW values to a vector as STORE rounds each, vround one
// value as STORE then LOAD do. Included after common.glsl.
#if defined(BF16) || defined(F16)
#define VW 8u
#define VT uvec4
#ifdef BF16
float vel(uvec4 v, uint e) {
    uint u = v[e >> 1];
    return uintBitsToFloat((e & 1u) == 0u ? u << 16 : u & 0xFFFF0000u);
}
uint vpair(float a, float b) { return fg_bf16(a) | (fg_bf16(b) << 16); }
float vround(float a) { return uintBitsToFloat(fg_bf16(a) << 16); }
#else
float vel(uvec4 v, uint e) { return float(unpackFloat2x16(v[e >> 1])[e & 1u]); }
uint vpair(float a, float b) { return packFloat2x16(f16vec2(a, b)); }
float vround(float a) { return float(float16_t(a)); }
#endif
uvec4 vpack(float f[VW]) { return uvec4(vpair(f[0], f[1]), vpair(f[2], f[3]), vpair(f[4], f[5]), vpair(f[6], f[7])); }
#else
#define VW 4u
#define VT vec4
float vel(vec4 v, uint e) { return v[e]; }
vec4 vpack(float f[VW]) { return vec4(f[0], f[1], f[2], f[3]); }
float vround(float a) { return a; }
#endif
