#version 450
// First half of a radix-sort pass (radix.glsl): hist[digit * blocks + block]
// = how many keys of the block have that digit (RADIX + 1 digits); then the
// last workgroup to finish (a counter, 0 at the start) turns hist, in place,
// into the place in the sorted output where each (digit, block)'s keys
// start: an exclusive scan in digit-major order (every key of digit 0, block
// by block, then digit 1, ...). Counting with shared-memory atomics gives the
// same counts in any order, so the sort is deterministic.
#include "radix.glsl"

layout(std430, set = 0, binding = 0) readonly buffer Keys { int keys[]; };
layout(std430, set = 0, binding = 1) coherent buffer Hist { uint hist[]; };
layout(std430, set = 0, binding = 2) coherent buffer Counter { uint counter[]; };
layout(push_constant, std430) uniform Push { uint n, rows, shift, raw; } p;

shared uint cnt[RADIX + 1u];
shared bool last;

void main() {
    uint t = gl_LocalInvocationID.x, blocks = (p.n + RADIX_BLOCK - 1u) / RADIX_BLOCK;
    for (uint blk = gl_WorkGroupID.x; blk < blocks; blk += gl_NumWorkGroups.x) {
        cnt[t] = 0u;
        if (t == 0u) cnt[RADIX] = 0u;
        barrier();
        uint i = blk * RADIX_BLOCK + t;
        if (i < p.n) {
            uint key = p.raw != 0u ? radix_raw_key(keys[i], p.rows) : uint(keys[i]);
            atomicAdd(cnt[radix_digit(key, p.shift, p.rows)], 1u);
        }
        barrier();
        hist[t * blocks + blk] = cnt[t];
        if (t == 0u) hist[RADIX * blocks + blk] = cnt[RADIX];
        barrier();   // cnt is read before the next block clears it
    }
    memoryBarrierBuffer();
    barrier();
    if (t == 0u) last = atomicAdd(counter[0], 1u) == gl_NumWorkGroups.x - 1u;
    barrier();
    if (!last) return;
    memoryBarrierBuffer();
    // invocation t scans digit t's row (blocks words) after the rows before it,
    // the last one digit RADIX's row too: rows t .. t + extra
    uint extra = t == RADIX - 1u ? 1u : 0u, total = 0u;
    for (uint b = 0u; b < (1u + extra) * blocks; ++b) total += hist[t * blocks + b];
    cnt[t] = total;
    barrier();
    for (uint off = 1u; off < RADIX; off <<= 1u) {   // inclusive scan of the digit totals
        uint v = t >= off ? cnt[t - off] : 0u;
        barrier();
        cnt[t] += v;
        barrier();
    }
    uint at = cnt[t] - total;
    for (uint b = 0u; b < (1u + extra) * blocks; ++b) {
        uint c = hist[t * blocks + b];
        hist[t * blocks + b] = at;
        at += c;
    }
}
