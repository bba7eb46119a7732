// variants: f32 f16
#version 450
// Tiled shared-memory SGEMM, batched, with operands addressed by strides (so
// a transposed operand is just swapped strides):
//   C[z](m, n) = sum_{r < R} sum_k A[z, r](m, k) * B[z, r](k, n)
// The r loop sums over broadcast batch dims inside the kernel (matmul's
// backward), z runs over the output batch (stride 0 = broadcast operand).
// Split-K: with klimit != 0, z instead runs over K-chunks of length K (the
// last one shorter), each writing a partial product for a later sum.
// 64x64 output tile per workgroup of 16x16 threads, 4x4 outputs each.
#include "common.glsl"
#define BM 64
#define BN 64
#define BK 16

layout(local_size_x = 16, local_size_y = 16) in;
layout(std430, set = 0, binding = 0) readonly buffer BufA { T a[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufB { T b[]; };
layout(std430, set = 0, binding = 2) writeonly buffer BufC { T c[]; };
layout(push_constant, std430) uniform Push {
    uint M, N, K;
    uint sam, sak;        // A(m, k) = a[offa + m*sam + k*sak]
    uint sbk, sbn;        // B(k, n) = b[offb + k*sbk + n*sbn]
    uint scm;             // C(m, n) = c[offc + m*scm + n]
    uint nz, za, zb, zc;  // output batch: count and per-operand strides
    uint R, ra, rb;       // summed batch: count and strides of A and B
    uint offa, offb, offc;
    uint klimit;          // split-K: the full K (0: no split)
} p;

// +1 padding: the k-fast tile loads store down columns without bank conflicts
shared float As[BK][BM + 1];
shared float Bs[BK][BN + 1];

void load_tiles(uint tid, uint abase, uint bbase, uint m0, uint n0, uint k0, uint kend) {
    bool a_kfast = p.sak == 1u;
    bool b_nfast = p.sbn == 1u;
    for (uint e = 0u; e < 4u; ++e) {
        uint l = tid + e * 256u;
        // coalesced: consecutive threads walk the operand's unit-stride dim
        uint mm = a_kfast ? l / BK : l % BM;
        uint ka = a_kfast ? l % BK : l / BM;
        float va = 0.0;
        if (m0 + mm < p.M && k0 + ka < kend)
            va = float(a[abase + (m0 + mm) * p.sam + (k0 + ka) * p.sak]);
        As[ka][mm] = va;
        uint nn = b_nfast ? l % BN : l / BK;
        uint kb = b_nfast ? l / BN : l % BK;
        float vb = 0.0;
        if (n0 + nn < p.N && k0 + kb < kend)
            vb = float(b[bbase + (k0 + kb) * p.sbk + (n0 + nn) * p.sbn]);
        Bs[kb][nn] = vb;
    }
}

void main() {
    uint tx = gl_LocalInvocationID.x, ty = gl_LocalInvocationID.y;
    uint tid = ty * 16u + tx;
    uint m0 = gl_WorkGroupID.y * BM, n0 = gl_WorkGroupID.x * BN;
    for (uint z = gl_WorkGroupID.z; z < p.nz; z += gl_NumWorkGroups.z) {
        float acc[4][4];
        for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) acc[i][j] = 0.0;
        uint kend = p.klimit == 0u ? p.K : min(p.K, p.klimit - z * p.K);
        for (uint r = 0u; r < p.R; ++r) {
            uint abase = p.offa + z * p.za + r * p.ra;
            uint bbase = p.offb + z * p.zb + r * p.rb;
            for (uint k0 = 0u; k0 < kend; k0 += BK) {
                load_tiles(tid, abase, bbase, m0, n0, k0, kend);
                barrier();
                for (uint kk = 0u; kk < BK; ++kk) {
                    float av[4], bv[4];
                    for (int i = 0; i < 4; ++i) av[i] = As[kk][ty + 16u * uint(i)];
                    for (int j = 0; j < 4; ++j) bv[j] = Bs[kk][tx + 16u * uint(j)];
                    for (int i = 0; i < 4; ++i)
                        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
                }
                barrier();
            }
        }
        uint cbase = p.offc + z * p.zc;
        for (int i = 0; i < 4; ++i) {
            uint m = m0 + ty + 16u * uint(i);
            if (m >= p.M) continue;
            for (int j = 0; j < 4; ++j) {
                uint n = n0 + tx + 16u * uint(j);
                if (n < p.N) c[cbase + m * p.scm + n] = T(acc[i][j]);
            }
        }
    }
}
