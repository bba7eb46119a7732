// Segmented tree reduction in shared memory. The workgroup (FG_WG threads,
// a power of two) is cut into segments of S consecutive lanes (S a power of
// two <= FG_WG); every lane of a segment gets its segment's total. Call from
// uniform control flow only (it contains barriers). Define FG_WG first.

shared vec2 fg_seg[FG_WG];

// op: 0 sums, 1 takes the max; both components are reduced.
vec2 fg_seg_reduce2(vec2 v, uint S, uint op) {
    uint lid = gl_LocalInvocationID.x;
    if (S == 1u) return v;
    fg_seg[lid] = v;
    barrier();
    for (uint s = S >> 1; s > 0u; s >>= 1) {
        if ((lid & (S - 1u)) < s) {
            vec2 o = fg_seg[lid + s];
            fg_seg[lid] = op == 1u ? max(fg_seg[lid], o) : fg_seg[lid] + o;
        }
        barrier();
    }
    vec2 r = fg_seg[lid & ~(S - 1u)];
    barrier();  // the next call may overwrite fg_seg
    return r;
}

float fg_seg_sum(float v, uint S) { return fg_seg_reduce2(vec2(v, 0.0), S, 0u).x; }
float fg_seg_max(float v, uint S) { return fg_seg_reduce2(vec2(v, 0.0), S, 1u).x; }
