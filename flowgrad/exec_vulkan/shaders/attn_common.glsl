// Shared by the attention kernels: the scalar ones (attn_tiles.glsl) and
// those on cooperative matrices (attn_coop.glsl). Their push block, bindings
// 0-3, the mask, and where a row and its statistics live:
// q, k, v, out and their gradients are row-major [batch, seq, d]; head h
// owns columns [h*dh, (h+1)*dh). Workgroup: x = row tile, y = head, z = batch.
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

#define NEG_INF uintBitsToFloat(0xff800000u)
#define POS_INF uintBitsToFloat(0x7f800000u)

layout(push_constant, std430) uniform Push {
    uint sq, sk;            // query and key sequence lengths
    uint d, dh;             // row width (all heads) and head width
    uint mask_mode;         // 0 none, 1 additive, 2 boolean (i32; nonzero attends)
    uint msb, msh, msi, msj;  // mask strides over (batch, head, query, key); 0 where broadcast
    float scale;            // 1/sqrt(dh)
    uint causal;            // key j attends to query i only where j <= i
    uint nstat;             // batch*heads*sq (offset of D in stats)
    uint saved_lse;         // stats pass: 1 the forward kept lse in stats, 0 recompute it
} p;

layout(std430, set = 0, binding = 0) readonly buffer Q { T q[]; };
layout(std430, set = 0, binding = 1) readonly buffer K { T k[]; };
#ifndef NO_V   // a kernel that does not read v binds something else at 2
layout(std430, set = 0, binding = 2) readonly buffer V { T v[]; };
#endif
// The mask is read as raw words so one binding serves an additive mask of
// the storage type and a boolean i32 mask.
#if defined(F16) || defined(BF16)
layout(std430, set = 0, binding = 3) readonly buffer Mask { uint16_t mbits[]; };
#ifdef BF16
float mask_add(uint e) { return uintBitsToFloat(uint(mbits[e]) << 16); }
#else
float mask_add(uint e) { return unpackHalf2x16(uint(mbits[e])).x; }
#endif
bool mask_keep(uint e) { return (uint(mbits[2u * e]) | uint(mbits[2u * e + 1u])) != 0u; }
#else
layout(std430, set = 0, binding = 3) readonly buffer Mask { uint mbits[]; };
float mask_add(uint e) { return uintBitsToFloat(mbits[e]); }
bool mask_keep(uint e) { return mbits[e] != 0u; }
#endif

// This workgroup's (row tile, head, batch). Under causality the work of a
// query tile grows with its index (it sees more keys) and that of a key tile
// shrinks; the device starts workgroups in order of their linear index (x
// fastest), so those ordered by work go out longest first over every head
// and batch, and the short ones fill in at the end. Without causality they
// keep the grid's order.
uvec3 own_tile(bool longest_last) {
    if (p.causal == 0u) return gl_WorkGroupID;
    uvec3 n = gl_NumWorkGroups;
    uint lin = gl_WorkGroupID.x + n.x * (gl_WorkGroupID.y + n.y * gl_WorkGroupID.z);
    uint t = lin / (n.y * n.z), hb = lin % (n.y * n.z);
    return uvec3(longest_last ? n.x - 1u - t : t, hb % n.y, hb / n.y);
}

// each row's slot in the stats buffers: its score max m at i, log l (l the sum
// of exp(s - m)) at nstat + i, D at 2 nstat + i. Kept apart, not as one
// log-sum-exp m + log l: where a mask puts a whole row near -1e8, f32 cannot
// hold m + log l, and exp(s - lse) would come back n times too large.
uint stat_index(uint b, uint h, uint i) {
    return (b * gl_NumWorkGroups.y + h) * p.sq + i;
}

// first element of row `row` of head h in batch b for a [batch, seq, d] tensor
uint row_base(uint b, uint seq, uint row, uint h) {
    return (b * seq + row) * p.d + h * p.dh;
}

// A scaled score after causality and the mask: -inf where query i may not
// see key j (also past either sequence's end).
float masked(float s, uint b, uint h, uint i, uint j) {
    if (i >= p.sq || j >= p.sk || (p.causal != 0u && j > i)) return NEG_INF;
    if (p.mask_mode != 0u) {
        uint e = b * p.msb + h * p.msh + i * p.msi + j * p.msj;
        if (p.mask_mode == 1u) s += mask_add(e);
        else if (!mask_keep(e)) s = NEG_INF;
    }
    return s;
}
