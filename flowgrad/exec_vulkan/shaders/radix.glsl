// Shared by radix_count.comp and radix_scatter.comp, the two halves of one
// pass of a stable least-significant-digit radix sort of ids with their
// positions: RADIX_BITS bits of the id a pass, the ids cut into blocks of
// RADIX_BLOCK (one per invocation; a workgroup takes one block at a time).
// Stable, so after the passes the ids are in order and equal ids keep their
// positions in order. The first pass (raw) reads the ids themselves and
// takes their positions as values. An id outside [0, rows) becomes `rows`
// and takes digit RADIX, after every other, in every pass: it sorts past
// every row without a pass of its own (a 256-row table sorts in one pass).
#define RADIX_BITS 8u
#define RADIX 256u          // digits of the id, one per invocation, and RADIX for an id out of range
#define RADIX_BLOCK 256u
layout(local_size_x = 256) in;

uint radix_raw_key(int id, uint rows) { return (id < 0 || uint(id) >= rows) ? rows : uint(id); }
uint radix_digit(uint key, uint shift, uint rows) { return key >= rows ? RADIX : (key >> shift) & (RADIX - 1u); }
