// Segmented tree reduction in shared memory. The workgroup (FG_WG threads,
// a power of two) is cut into segments of S lanes (S a power of two <= FG_WG),
// one segment per output; every lane of a segment gets its segment's total.
// Call fg_seg_reduce2 from uniform control flow only (it has barriers).
//
// Lane layout: `interleaved` false puts a segment's lanes on consecutive
// threads (right when a segment walks contiguous memory: a row reduction);
// true strides them by FG_WG / S, so consecutive threads hold consecutive
// outputs at the same step (right when the outputs are the contiguous ones:
// a column reduction). Either way the loads of a warp stay coalesced.
// Define FG_WG first (and FG_LID, the thread's number in the segment layout,
// where it is not gl_LocalInvocationID.x).

#ifndef FG_LID
#define FG_LID gl_LocalInvocationID.x
#endif

shared vec2 fg_seg[FG_WG];

uint fg_seg_lane(uint S, bool interleaved) {
    uint lid = FG_LID;
    return interleaved ? lid / (FG_WG / S) : lid & (S - 1u);
}

// which of the workgroup's FG_WG / S segments this thread is in
uint fg_seg_slot(uint S, bool interleaved) {
    uint lid = FG_LID;
    return interleaved ? lid % (FG_WG / S) : lid / S;
}

// op: 0 sums, 1 takes the max, 2 the min; both components are reduced.
vec2 fg_seg_reduce2(vec2 v, uint S, uint op, bool interleaved) {
    if (S == 1u) return v;
    uint lid = FG_LID;
    uint step = interleaved ? FG_WG / S : 1u;
    uint lane = fg_seg_lane(S, interleaved);
    fg_seg[lid] = v;
    barrier();
    for (uint s = S >> 1; s > 0u; s >>= 1) {
        if (lane < s) {
            vec2 o = fg_seg[lid + s * step];
            fg_seg[lid] = op == 1u ? fg_nanmax(fg_seg[lid], o)
                        : op == 2u ? fg_nanmin(fg_seg[lid], o) : fg_seg[lid] + o;
        }
        barrier();
    }
    vec2 r = fg_seg[lid - lane * step];
    barrier();  // the next call may overwrite fg_seg
    return r;
}

float fg_seg_sum(float v, uint S, bool interleaved) { return fg_seg_reduce2(vec2(v, 0.0), S, 0u, interleaved).x; }
float fg_seg_max(float v, uint S, bool interleaved) { return fg_seg_reduce2(vec2(v, 0.0), S, 1u, interleaved).x; }
