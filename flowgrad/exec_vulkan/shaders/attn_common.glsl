// Shared by the attention kernels (included after MAXD is defined).
// Layout: q, k, v, out and their gradients are row-major [batch, seq, d];
// head h owns columns [h*dh, (h+1)*dh). A head row is held as vec4 chunks,
// zero-padded past dh, so the padding adds nothing to dot products.
// Workgroup: x = row tile, y = head, z = batch. Each row is owned by LANES
// adjacent threads that split the streamed rows of the other side between
// them (lane l takes every LANES-th one) and combine their partial results
// at the end through shared memory: LANES times the parallelism of one
// thread per row, with the same per-thread state.
#define NC (MAXD / 4)
#define ROWS 32                 // rows per workgroup
#define LANES 4                 // threads per row
#define TILE (2048 / MAXD)      // streamed rows per shared tile (two tiles: 16 KiB + padding)
#define PER_LANE (TILE / LANES) // streamed rows per lane per tile
#define PAD (NC + 1)            // tile row stride in vec4: lanes read different rows conflict-free
#define NEG_INF uintBitsToFloat(0xff800000u)

layout(local_size_x = ROWS * LANES) in;

layout(push_constant, std430) uniform Push {
    uint sq, sk;       // query and key sequence lengths
    uint d, dh;        // row width (all heads) and head width
    uint has_mask;     // additive mask bound at the mask binding
    uint msi, msj;     // mask strides over (query, key); 0 where broadcast
    float scale;       // 1/sqrt(dh)
    uint nstat;        // backward: batch*heads*sq (offset of D in stats)
} p;

shared vec4 red[ROWS * LANES * LANES];
shared float red_m[ROWS * LANES];
shared float red_l[ROWS * LANES];

// first element of row `row` of head h in batch b for a [batch, seq, d] tensor
uint row_base(uint b, uint seq, uint row, uint h) {
    return (b * seq + row) * p.d + h * p.dh;
}

// Online-softmax states (m, l) of a row's lanes merged: every lane gets the
// row's max m and its sum l rescaled to that max. Call from uniform control flow.
void lanes_softmax(inout float m, inout float l, uint row, uint lane) {
    barrier();
    red_m[row * LANES + lane] = m;
    red_l[row * LANES + lane] = l;
    barrier();
    float mx = NEG_INF;
    for (uint k = 0u; k < LANES; ++k) mx = max(mx, red_m[row * LANES + k]);
    float mref = mx == NEG_INF ? 0.0 : mx;
    float sum = 0.0;
    for (uint k = 0u; k < LANES; ++k) sum += red_l[row * LANES + k] * exp(red_m[row * LANES + k] - mref);
    m = mx;
    l = sum;
}

// acc <- sum over the row's lanes of f * acc (every lane gets the total).
// nc: live vec4 chunks (uniform). Call from uniform control flow.
void lanes_sum(inout vec4 acc[NC], float f, uint nc, uint row, uint lane) {
    uint base = row * LANES;
    for (uint c0 = 0u; c0 < NC; c0 += LANES) {
        if (c0 >= nc) break;
        barrier();
        for (uint i = 0u; i < LANES; ++i) red[(base + lane) * LANES + i] = acc[c0 + i] * f;
        barrier();
        for (uint i = 0u; i < LANES; ++i) {
            vec4 t = vec4(0.0);
            for (uint k = 0u; k < LANES; ++k) t += red[(base + k) * LANES + i];
            acc[c0 + i] = t;
        }
    }
}
