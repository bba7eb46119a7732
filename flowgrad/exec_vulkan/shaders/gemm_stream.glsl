// Stream-K, for the GEMM bodies' _sk builds (matmul_coop.glsl, matmul_cm2.glsl; f32 partials,
// one summed product: R = 1): the grid's G workgroups share the product's steps evenly, U =
// tiles * T (T = ceil(K / BK) a tile), workgroup w taking steps [w U / G, (w + 1) U / G): the end
// of one output tile and the start of the next, so a grid of fewer tiles than the GPU holds
// still fills it. Each piece's partial goes in f32 to slab s of C (slabs of nz * M * N; s: the
// piece's rank among its tile's), and stream_sum.comp adds each tile's slabs in order. Tiles are
// numbered along rows where N >= M, else along columns, batch outermost: the host picks G so that
// the tiles reading one panel of the larger operand take the same steps at the same time (and
// keeps U * G under 2^32, and G at most U: a piece's slab is its workgroup's distance from the
// tile's first, which ranks it only where no workgroup's share is empty). The includer has
// declared the push block p (gemm_push.glsl's).

struct Piece {
    uint z, m0, n0;   // the tile
    uint k0, steps;   // its steps k0 / BK .. k0 / BK + steps - 1
    uint cbase;       // where its slab of C holds the tile's product
};

uint stream_steps() { return (p.K + BK - 1u) / BK; }

uint stream_total() { return p.nz * ((p.M + BM - 1u) / BM) * ((p.N + BN - 1u) / BN) * stream_steps(); }

// the workgroup whose steps hold `step`
uint first_group(uint step) { return ((step + 1u) * gl_NumWorkGroups.x - 1u) / stream_total(); }

// the piece starting at step u of the workgroup whose steps end before `end`
Piece stream_piece(uint u, uint end) {
    uint tiles_m = (p.M + BM - 1u) / BM, tiles_n = (p.N + BN - 1u) / BN, per = tiles_m * tiles_n;
    uint T = stream_steps(), t = u / T, s0 = u % T;
    uint r = t % per;
    Piece q;
    q.z = t / per;
    q.m0 = (p.N >= p.M ? r / tiles_n : r % tiles_m) * BM;
    q.n0 = (p.N >= p.M ? r % tiles_n : r / tiles_m) * BN;
    q.k0 = s0 * BK;
    q.steps = min(T - s0, end - u);
    q.cbase = p.offc + ((gl_WorkGroupID.x - first_group(t * T)) * p.nz + q.z) * p.zc;
    return q;
}

// a workgroup's first step and the end of its steps
#define STREAM_RANGE(first, end) \
    uint first = gl_WorkGroupID.x * stream_total() / gl_NumWorkGroups.x; \
    uint end = (gl_WorkGroupID.x + 1u) * stream_total() / gl_NumWorkGroups.x;
