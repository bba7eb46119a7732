// variants: f32 f16 bf16
#version 450
// Generic strided copy: dst[dst_off + idx.dstride] = src[src_off + idx.sstride]
// for every multi-index idx of `shape` (row-major order). Serves reshape-free
// data movement: transpose, permute, slice and its backward window, concat,
// broadcast expansion. A bit copy: the 32-bit build moves f32 and i32 alike.
#ifdef F16
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#define W float16_t
#elif defined(BF16)
#extension GL_EXT_shader_16bit_storage : require
#define W uint16_t
#else
#define W uint
#endif
#define MAXR 8

layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 0) readonly buffer Src { W src[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Dst { W dst[]; };
layout(push_constant, std430) uniform Push {
    uint n, rank, src_off, dst_off;
    uint shape[MAXR];
    uint sstride[MAXR];
    uint dstride[MAXR];
} p;

void main() {
    uint step = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < p.n; i += step) {
        uint r = i, s = p.src_off, d = p.dst_off;
        for (int k = int(p.rank) - 1; k >= 0; --k) {
            uint c = r % p.shape[k];
            r /= p.shape[k];
            s += c * p.sstride[k];
            d += c * p.dstride[k];
        }
        dst[d] = src[s];
    }
}
