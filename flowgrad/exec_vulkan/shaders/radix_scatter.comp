#version 450
// Second half of a radix-sort pass (radix.glsl): each key and its value go
// to the place radix_count found for its (digit, block), plus its rank among
// the keys of the block with the same digit that come before it. That rank
// keeps equal digits in order (the sort is stable) and takes at most
// RADIX_BLOCK - 1 reads of shared memory per key.
#include "radix.glsl"

layout(std430, set = 0, binding = 0) readonly buffer KeysIn { int keys_in[]; };
layout(std430, set = 0, binding = 1) readonly buffer ValsIn { uint vals_in[]; };
layout(std430, set = 0, binding = 2) readonly buffer Hist { uint hist[]; };
layout(std430, set = 0, binding = 3) writeonly buffer KeysOut { uint keys_out[]; };
layout(std430, set = 0, binding = 4) writeonly buffer ValsOut { uint vals_out[]; };
layout(push_constant, std430) uniform Push { uint n, rows, shift, raw; } p;

shared uint sdigit[RADIX_BLOCK];

void main() {
    uint t = gl_LocalInvocationID.x, blocks = (p.n + RADIX_BLOCK - 1u) / RADIX_BLOCK;
    for (uint blk = gl_WorkGroupID.x; blk < blocks; blk += gl_NumWorkGroups.x) {
        uint i = blk * RADIX_BLOCK + t, key = 0u, val = 0u, digit = RADIX + 1u;   // no key here
        if (i < p.n) {
            key = p.raw != 0u ? radix_raw_key(keys_in[i], p.rows) : uint(keys_in[i]);
            val = p.raw != 0u ? i : vals_in[i];
            digit = radix_digit(key, p.shift, p.rows);
        }
        sdigit[t] = digit;
        barrier();
        if (i < p.n) {
            uint rank = 0u;
            for (uint j = 0u; j < t; ++j) rank += sdigit[j] == digit ? 1u : 0u;
            uint at = hist[digit * blocks + blk] + rank;
            keys_out[at] = key;
            vals_out[at] = val;
        }
        barrier();   // sdigit is read before the next block writes it
    }
}
