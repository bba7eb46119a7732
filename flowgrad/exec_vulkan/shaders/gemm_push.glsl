// The push block the GEMM kernels share (lower/linalg.py's _Gemm.push writes it):
//   C[z](m, n) = sum_{r < R} A[z, r](m, k) B[z, r](k, n)
// and the names matmul_tiled.glsl's and matmul_coop.glsl's bodies read it by.
// A kernel opens its push block with GEMM_PUSH and may add fields after it.
#define GEMM_PUSH \
    uint M, N, K; \
    uint sam, sak;        /* A(m, k) = a[offa + m*sam + k*sak] */ \
    uint sbk, sbn;        /* B(k, n) = b[offb + k*sbk + n*sbn] */ \
    uint scm;             /* C(m, n) = c[offc + m*scm + n] */ \
    uint nz, za, zb, zc;  /* output batch: count and per-operand strides */ \
    uint R, ra, rb;       /* summed batch: count and strides of A and B */ \
    uint offa, offb, offc; \
    uint klimit;          /* split-K: the full K (0: no split) */ \
    uint amode, bmode, cvec;  /* the vector forms the host checked (what each kernel makes of them) */

#define GEMM_M p.M
#define GEMM_N p.N
#define GEMM_K p.K
#define GEMM_NZ p.nz
#define GEMM_R p.R
#define GEMM_KEND(z) (p.klimit == 0u ? p.K : min(p.K, p.klimit - (z) * p.K))
#define A_KFAST (p.sak == 1u)
#define B_NFAST (p.sbn == 1u)
#define A_BASE(z, r) (p.offa + (z) * p.za + (r) * p.ra)
#define B_BASE(z, r) (p.offb + (z) * p.zb + (r) * p.rb)
