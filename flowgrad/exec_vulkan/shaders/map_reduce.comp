// variants: f32 f16 bf16
#version 450
// One kernel for every elementwise op and every axis reduction:
//   y[o] = scale * REDUCE_{r < R} MAP(x0[i0], x1[i1], x2[i2])
// over a logical index space of rank <= 6. Each input is addressed by its own
// strides in that space (0 on a broadcast axis), so numpy broadcasting,
// keepdims gradients and "sum the gradient over the broadcast axes" are all
// the same loop. Axes in `redmask` are reduced (R = their size product); the
// others (n_out = their size product) index the contiguous output, in order.
// A workgroup is cut into segments of S lanes (S = 1: one output per thread,
// plain elementwise; S = 256: one output per workgroup, a long reduction;
// see segment_reduce.glsl for the lane layout bit).
// A reduction cut into chunks (below) writes its pieces (in f32, whatever T
// is: a chunked 16-bit sum rounds once, as an unchunked one does), and the
// last chunk of each output to finish (a per-output counter, 0 at the start)
// reduces that output's pieces, in chunk order, into y: the whole reduction
// in one dispatch, its result independent of arrival order.
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

#define FG_WG 256
#define UNROLL 8u
layout(local_size_x = FG_WG) in;

#include "fg_math.glsl"
#include "segment_reduce.glsl"

layout(std430, set = 0, binding = 0) readonly buffer In0 { T x0[]; };
layout(std430, set = 0, binding = 1) readonly buffer In1 { T x1[]; };
layout(std430, set = 0, binding = 2) readonly buffer In2 { T x2[]; };
layout(std430, set = 0, binding = 3) writeonly buffer Out { T y[]; };
layout(std430, set = 0, binding = 4) coherent buffer Counts { uint counts[]; };   // one per output
// the pieces, through coherent stores and loads: another workgroup reduces them
layout(std430, set = 0, binding = 5) coherent buffer Pieces { float pieces[]; };

layout(push_constant) uniform Push {
    uint n_out;     // outputs written: kept elements x chunks
    uint R;         // reduced elements per kept element (1: no reduction)
    uint S;         // lanes per output (power of two)
    uint code;      // map op | reduce op << 8 | interleaved lanes << 12 | rank << 13 | redmask << 16
                    // | inputs bound << 22
    uint chunks;    // the reduced range is cut in this many pieces, each summed
                    // to its own slot, chunk-major (pieces[c * n_kept + o]), then
                    // reduced into y
    float scale;    // applied to each output
    float param;    // the map op's scalar (pow's exponent)
    uint shape[6];
    uint st0[6];
    uint st1[6];
    uint st2[6];
} pc;

#include "map_ops.glsl"
#include "map_apply.glsl"

// rop: 0 sum, 1 max, 2 min (NaN propagates through max and min)
float fold(uint rop, float acc, float v) {
    return rop == 1u ? fg_nanmax(acc, v) : rop == 2u ? fg_nanmin(acc, v) : acc + v;
}

// b and c are read only from inputs the dispatch binds (code bits 22-23: how many)
float map_value(uint op, uint nin, uint i0, uint i1, uint i2) {
    float b = nin > 1u ? LOAD(x1[i1]) : 0.0;
    float c = nin > 2u ? LOAD(x2[i2]) : 0.0;
    return map_apply(op, LOAD(x0[i0]), b, c, pc.param);
}

void main() {
    uint S = pc.S;
    bool il = ((pc.code >> 12) & 1u) != 0u;
    int rank = int((pc.code >> 13) & 7u);
    uint redmask = (pc.code >> 16) & 0x3fu;
    uint n_kept = pc.n_out / pc.chunks;
    uint piece = (pc.R + pc.chunks - 1u) / pc.chunks;
    uint lane = fg_seg_lane(S, il);
    uint per_group = FG_WG / S;
    uint mop = pc.code & 0xffu;
    uint nin = (pc.code >> 22) & 3u;
    uint rop = (pc.code >> 8) & 0xfu;
    // a plain map (R = 1) starts its "sum" from -0.0, which adds to any v as
    // v: from 0.0 a map's -0.0 became 0.0 (sqrt(-0.0), whose 1 / y is -inf).
    // A longer sum starts from 0.0, as PyTorch's (a sum of -0.0s is 0.0).
    float identity = rop == 1u ? -fg_inf() : rop == 2u ? fg_inf() : pc.R == 1u ? -0.0 : 0.0;
    // grid-stride over outputs; the trip count is uniform in a workgroup,
    // as the barriers in fg_seg_reduce2 require
    for (uint base = gl_WorkGroupID.x * per_group; base < pc.n_out;
         base += gl_NumWorkGroups.x * per_group) {
        uint slot_out = base + fg_seg_slot(S, il);
        float acc = identity;
        if (slot_out < pc.n_out) {
            uint chunk = slot_out / n_kept;
            uint o = slot_out - chunk * n_kept;
            uint r_end = min(pc.R, (chunk + 1u) * piece);
            uint k0 = 0u, k1 = 0u, k2 = 0u, rest = o;
            for (int d = rank - 1; d >= 0; --d) {
                if (((redmask >> d) & 1u) == 0u) {
                    uint c = rest % pc.shape[d];
                    rest /= pc.shape[d];
                    k0 += c * pc.st0[d];
                    k1 += c * pc.st1[d];
                    k2 += c * pc.st2[d];
                }
            }
            uint r = chunk * piece + lane;
#if defined(F16) || defined(BF16)
            if (bitCount(redmask) == 1u) {
                // one reduced axis (a bias gradient's column sums, a row's sum): each r is its
                // own coordinate, so no division; UNROLL loads go out together (a 2-byte
                // column sum waits on memory) and are folded in the plain loop's order. The
                // 16-bit builds only: in f32 this loop made GPT-2's whole step slower on an H100
                int d = findLSB(redmask);
                uint s0 = pc.st0[d], s1 = pc.st1[d], s2 = pc.st2[d];
                for (; r + (UNROLL - 1u) * S < r_end; r += UNROLL * S) {
                    float a[UNROLL], b[UNROLL], c[UNROLL];
                    [[unroll]] for (uint u = 0u; u < UNROLL; ++u) {
                        uint q = r + u * S;
                        a[u] = LOAD(x0[k0 + q * s0]);
                        b[u] = nin > 1u ? LOAD(x1[k1 + q * s1]) : 0.0;
                        c[u] = nin > 2u ? LOAD(x2[k2 + q * s2]) : 0.0;
                    }
                    [[unroll]] for (uint u = 0u; u < UNROLL; ++u)
                        acc = fold(rop, acc, map_apply(mop, a[u], b[u], c[u], pc.param));
                }
                for (; r < r_end; r += S)
                    acc = fold(rop, acc, map_value(mop, nin, k0 + r * s0, k1 + r * s1, k2 + r * s2));
            }
#endif
            for (; r < r_end; r += S) {
                uint i0 = k0, i1 = k1, i2 = k2, rr = r;
                for (int d = rank - 1; d >= 0; --d) {
                    if (((redmask >> d) & 1u) != 0u) {
                        uint c = rr % pc.shape[d];
                        rr /= pc.shape[d];
                        i0 += c * pc.st0[d];
                        i1 += c * pc.st1[d];
                        i2 += c * pc.st2[d];
                    }
                }
                float v = map_value(mop, nin, i0, i1, i2);
                acc = fold(rop, acc, v);
            }
        }
        acc = fg_seg_reduce2(vec2(acc, 0.0), S, rop, il).x;
        if (lane == 0u && slot_out < pc.n_out) {
            if (pc.chunks == 1u) {
                y[slot_out] = STORE(acc * pc.scale);
            } else {
                pieces[slot_out] = acc;
                memoryBarrierBuffer();
                uint o = slot_out % n_kept;
                if (atomicAdd(counts[o], 1u) == pc.chunks - 1u) {
                    memoryBarrierBuffer();
                    float total = identity;
                    for (uint c = 0u; c < pc.chunks; ++c) {
                        total = fold(rop, total, pieces[c * n_kept + o]);
                    }
                    y[o] = STORE(total * pc.scale);
                }
            }
        }
    }
}
