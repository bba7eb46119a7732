// variants: f32 f16 bf16
#version 450
// dtable[v, :] = sum over positions i with ids[i] == v of g[i, :], from the
// positions sorted by id (keys: the sorted ids, vals: their positions, in
// position order within an id; radix_count/radix_scatter), so each g row is
// read once and each row an id picks written once: work in proportion to
// ids x d, whatever the table's size. The caller zeroes dtable first (the
// rows no id picks). A sorted key equal to rows is an id outside the table:
// nothing is written for it.
//
// The kernel this replaces gave each workgroup 8 table rows x 64 columns and
// had it scan every id for its rows: rows/8 x d/64 workgroups each reading
// all the ids, rows x ids x d / 8 steps that almost all find nothing (40
// billion at a 50304 x 768 table and 8192 ids: 15 ms on an H100). Splitting
// the ids into chunks filled a GPU for a small table and did nothing for a
// large one.
//
// The sorted order is cut into runs of RUN entries; a workgroup takes one run
// and COLS columns, and sums each id's entries in the run in order (loads in
// batches of 8, to keep them in flight). An id whose entries all lie in the
// run is written to its row. One whose entries cross into a neighbouring run
// writes its piece (in f32) to parts, at slot 2 * run when the piece starts
// the run, else 2 * run + 1 (a run holds at most those two); then the last of
// its pieces to arrive (a counter per id and column tile, 0 at the start)
// sums the pieces in run order into the row. Every sum has one fixed order:
// the result is deterministic, with no float atomics, and no invocation
// serially reads more than RUN rows of g (plus one piece per run an id spans).
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#define RUN 32u
#define COLS 64u
#define NONE 0xFFFFFFFFu

layout(local_size_x = COLS) in;
layout(std430, set = 0, binding = 0) readonly buffer Keys { uint keys[]; };
layout(std430, set = 0, binding = 1) readonly buffer Vals { uint vals[]; };
layout(std430, set = 0, binding = 2) readonly buffer G { T g[]; };
layout(std430, set = 0, binding = 3) writeonly buffer DTable { T dtable[]; };
layout(std430, set = 0, binding = 4) coherent buffer Parts { float parts[]; };
layout(std430, set = 0, binding = 5) coherent buffer Counts { uint counts[]; };   // one per run and column tile
layout(push_constant, std430) uniform Push { uint n, d, rows; } p;

shared uint skey[RUN];
shared uint sval[RUN];
shared uint edge[2];   // the keys just before and just after the run (NONE past an end)
shared bool last;

// the first index whose key is >= key (above: > key)
uint bound(uint key, bool above) {
    uint lo = 0u, hi = p.n;
    while (lo < hi) {
        uint mid = (lo + hi) / 2u, k = keys[mid];
        if (k < key || (above && k == key)) lo = mid + 1u;
        else hi = mid;
    }
    return lo;
}

// After a piece of `key`'s entries went to parts: the last piece to arrive
// sums them all, run by run, into the key's row.
void join(uint key, uint col, uint tile) {
    uint lo = bound(key, false), hi = bound(key, true);
    uint r0 = lo / RUN, r1 = (hi - 1u) / RUN;
    memoryBarrierBuffer();
    barrier();
    if (gl_LocalInvocationID.x == 0u) last = atomicAdd(counts[r0 * gl_NumWorkGroups.x + tile], 1u) == r1 - r0;
    barrier();
    bool mine = last;
    barrier();   // every invocation has read the flag before the next join writes it
    if (!mine || col >= p.d) return;
    memoryBarrierBuffer();
    // r0's piece is the one starting the run only when the key's entries start there
    float s = parts[(2u * r0 + (lo == r0 * RUN ? 0u : 1u)) * p.d + col];
    uint r = r0 + 1u;
    for (; r + 4u <= r1 + 1u; r += 4u) {
        float a0 = parts[2u * r * p.d + col], a1 = parts[2u * (r + 1u) * p.d + col];
        float a2 = parts[2u * (r + 2u) * p.d + col], a3 = parts[2u * (r + 3u) * p.d + col];
        s = (((s + a0) + a1) + a2) + a3;
    }
    for (; r <= r1; ++r) s += parts[2u * r * p.d + col];
    dtable[key * p.d + col] = STORE(s);
}

void main() {
    uint t = gl_LocalInvocationID.x, tile = gl_WorkGroupID.x, col = tile * COLS + t;
    uint runs = (p.n + RUN - 1u) / RUN;
    for (uint run = gl_WorkGroupID.y; run < runs; run += gl_NumWorkGroups.y) {
        uint first = run * RUN, cnt = min(RUN, p.n - first);
        if (t < cnt) {
            skey[t] = keys[first + t];
            sval[t] = vals[first + t];
        }
        if (t == 0u) {
            edge[0] = first > 0u ? keys[first - 1u] : NONE;
            edge[1] = first + cnt < p.n ? keys[first + cnt] : NONE;
        }
        barrier();
        uint key0 = skey[0], key1 = skey[cnt - 1u];
        // the run's first piece crosses when its key goes on before the run, or
        // (the whole run one key) after it; its last piece, a second key's, after it
        bool cross0 = key0 == edge[0] || (key0 == key1 && key1 == edge[1]);
        bool cross1 = key1 != key0 && key1 == edge[1];
        float acc = 0.0;
        uint start = 0u;
        for (uint j0 = 0u; j0 < cnt; j0 += 8u) {
            float v[8];
            [[unroll]] for (uint k = 0u; k < 8u; ++k)
                v[k] = (j0 + k < cnt && col < p.d) ? LOAD(g[sval[j0 + k] * p.d + col]) : 0.0;
            [[unroll]] for (uint k = 0u; k < 8u; ++k) {
                uint j = j0 + k;
                if (j >= cnt) break;
                acc += v[k];
                if (j + 1u < cnt && skey[j + 1u] == skey[j]) continue;
                uint key = skey[j];
                bool crosses = start == 0u ? cross0 : (j + 1u == cnt && cross1);
                if (col < p.d && key < p.rows) {
                    if (crosses) parts[(2u * run + (start == 0u ? 0u : 1u)) * p.d + col] = acc;
                    else dtable[key * p.d + col] = STORE(acc);
                }
                acc = 0.0;
                start = j + 1u;
            }
        }
        if (cross0 && key0 < p.rows) join(key0, col, tile);
        if (cross1 && key1 < p.rows) join(key1, col, tile);
        barrier();   // skey, sval and edge are read before the next run writes them
    }
}
