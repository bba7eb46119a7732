// Shared by the attention kernels (included after MAXD is defined).
// Layout: q, k, v, out and their gradients are row-major [batch, seq, d];
// head h owns columns [h*dh, (h+1)*dh). A head row is held as vec4 chunks,
// zero-padded past dh, so the padding adds nothing to dot products.
// Workgroup: x = row tile, y = head, z = batch; one thread per row.
#define NC (MAXD / 4)
#define ROWS 64                 // rows (threads) per workgroup
#define TILE (2048 / MAXD)      // rows per shared tile: two tiles = 16 KiB
#define NEG_INF uintBitsToFloat(0xff800000u)

layout(local_size_x = ROWS) in;

layout(push_constant, std430) uniform Push {
    uint sq, sk;       // query and key sequence lengths
    uint d, dh;        // row width (all heads) and head width
    uint has_mask;     // additive mask bound at the mask binding
    uint msi, msj;     // mask strides over (query, key); 0 where broadcast
    float scale;       // 1/sqrt(dh)
    uint nstat;        // backward: batch*heads*sq (offset of D in stats)
} p;

// first element of row `row` of head h in batch b for a [batch, seq, d] tensor
uint row_base(uint b, uint seq, uint row, uint h) {
    return (b * seq + row) * p.d + h * p.dh;
}
