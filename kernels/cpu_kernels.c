/* ckptq CPU kernels: blockwise 8-, 6-, 4- and 2-bit quantize / dequantize, and the one step of every
 * optimizer (step.h: decode -> rule -> encode over groups of parameters, each rule of step_rules.h written
 * once).
 *
 * Plain C99 with no Python or torch headers, compiled on first use by kernels/native.py
 * (`cc -O3 -march=native -ffp-contract=off -fno-math-errno`) and called through ctypes, which releases
 * the GIL: the Python side (backend_native.py) runs the calls on a thread pool, each on a range of blocks,
 * or, for the step, each taking work items from a shared counter.
 *
 * Vector code: everything is built on the SIMD layer (simd.h: the instruction set the build targets,
 * AVX-512, AVX2, aarch64 NEON or scalar C, each in a header of its own, and the codec's blocks written once
 * over them); the step's rules are written over the layer's vector type, so every path runs them vectorized.
 *
 * Every function here equals a PyTorch reference bit for bit, on every path (tests/kernels/test_quantize.py,
 * tests/kernels/test_step.py and the other tests/kernels/test_step_*.py, and for the builds this machine cannot load, aarch64 ones under qemu,
 * tests/kernels/test_simd_driver.py (the codec) and tests/kernels/test_step_driver.py (the steps)):
 *   ckq_quantize           <-> ckptq.kernels.backend_torch.quantize (reference_codes after the transform)
 *   ckq_dequantize         <-> ckptq.kernels.backend_torch.dequantize
 *   ckq_step_group         <-> ckptq.kernels.step_torch.step_group (contract.Group: every rule)
 *   ckq_dense_group        <-> ckptq.kernels.step_torch.dense_group (contract.Dense)
 * That is why no FMA contraction is allowed (-ffp-contract=off, and no fma intrinsics): each product and
 * sum is rounded to fp32 on its own, in the order the reference writes it. Division and sqrt are IEEE
 * (correctly rounded), scalar and vector alike.
 *
 * Row layout (ckptq.kernels.contract, "Rows"): a tensor of n elements is n / row_len rows; blocks never
 * cross a row (row r holds blocks_per_row = ceil(row_len / block) blocks, the last one maybe short), each
 * row's codes start on a byte (row_bytes = ceil(row_len * bits / 8)) and the scales are row-major. The
 * kernels address blocks by their index b in that order: block b is block j = b % blocks_per_row of row
 * r = b / blocks_per_row, its elements start at r * row_len + j * block, its codes at byte
 * r * row_bytes + j * block * bits / 8 (block sizes are multiples of 4: every block starts on a byte), its
 * scale is absmax[b]. One row of all n elements (row_len = n) is the flat layout.
 *
 * Rounding contract (ckptq.kernels.lut): code = #{j : t[j] < y} with t the 255 codebook midpoints and
 * y = x / absmax (IEEE division; an all-zero block divides by 1). The code table makes that one lookup
 * and one add: the 2^16 buckets are the floats sharing their top 16 bits, indexed by the signed
 * (bits >> 16) from the table's middle; entry e = base << 17 | (2^17 - limit) where base = #{t < every y
 * of the bucket} and limit is the rank (the position in increasing value order, 0..65535, inside the
 * bucket) of the first y above the one threshold that may lie inside the bucket (65536: none). Then
 * (e + rank(y)) >> 17 is base + (rank(y) >= limit): the low field carries into bit 17 exactly when
 * rank(y) >= limit. NaN buckets hold the top code (searchsorted's answer for NaN), and every NaN that
 * division makes is quiet, so in such a bucket. ckptq.kernels.lut.native_code_table builds the table.
 * (Before, the entry held the limit itself and the code took a compare, a masked add and a NaN test:
 * the add form makes the step's two encodes 12 instructions shorter per 16 elements.)
 *
 * The vector loops the next paragraphs describe are AVX-512's (simd_avx512.h); simd_avx2.h and simd_neon.h
 * say what stands in for each on their paths.
 *
 * 4-bit codes (bits == 4): the same table over 15 thresholds gives codes 0..15 (NaN: 15); the vector
 * loops get the same count from a binary search of the 15 thresholds held in one register (four
 * permutes instead of a gather from the 256 KB table, which made the 4-bit step as fast as the 8-bit
 * one again once it rounds stochastically). Codes are packed two to a
 * byte, element 2i in the low nibble of byte i (ckptq.kernels.contract). Every block starts on a byte
 * (block sizes are even). Encoding packs pairs of codes as it goes; decoding splits nibbles and looks
 * them up in a 16-entry codebook held in one AVX-512 register (vpermps), or per element in scalar C.
 * The codebooks the caller passes for decoding always have 256 entries (a 16-entry one padded with
 * zeros), so table reads stay in bounds whatever the width.
 *
 * 6- and 2-bit codes (and 4-bit ones in the step when its moments differ in width): the codes are one
 * little-endian bit stream, element i in bits [i * bits, (i + 1) * bits) (ckptq.kernels.contract), so
 * 16 codes fill 2 * bits bytes. The vector loops unpack 16 codes with two dword permutes of the bytes
 * (each code lies in the 16-bit window at its first byte) and a variable shift, and pack 16 by shifting
 * each code into its group word (4 codes of 2 or 6 bits: 1 or 3 bytes) and or-ing the 4 lanes of each
 * 128-bit lane together. Codebooks of up to 16 entries are looked up with one permute, 64-entry ones
 * with two two-register permutes and a blend, 256-entry ones with a gather. The step takes a code width
 * per slot (the 4-bit budget stores Adam's ratio in 6 bits and sqrt(v) in 2).
 */
#define _DEFAULT_SOURCE  /* madvise under -std=c99 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif
#include "simd.h"  /* the SIMD layer: vector operations per instruction set, and the codec's blocks over them */

#define MAX_BLOCK 4096  /* the largest block size; the exported functions return -1 for others */
#define BAD_BLOCK(block) ((block) < 1 || (block) > MAX_BLOCK)
/* code widths 8, 6, 4, 2; a block must start on a byte: a multiple of 4 codes (2 for 4 bits) */
#define BAD_BITS(bits, block) (((bits) != 8 && (bits) != 6 && (bits) != 4 && (bits) != 2) || \
                               ((bits) != 8 && (block) % ((bits) == 4 ? 2 : 4)))


/* A walk over a tensor's blocks in the row layout (see the header), from block b on: rows_next steps to
 * the next block. */
typedef struct {
    int64_t row_len, block;  /* elements per row, block size */
    int64_t row, col;        /* the current block's row and first column */
} rows_t;

static inline rows_t rows_at(int64_t row_len, int64_t block, int64_t b) {
    int64_t per_row = (row_len + block - 1) / block, row = b / per_row;
    rows_t at = {row_len, block, row, (b - row * per_row) * block};
    return at;
}

static inline void rows_next(rows_t *at) {
    at->col += at->block;
    if (at->col >= at->row_len) {
        at->col = 0;
        at->row++;
    }
}

/* The current block's first element and its length (the last block of a row may be short). */
static inline int64_t rows_offset(const rows_t *at) { return at->row * at->row_len + at->col; }

static inline int rows_len(const rows_t *at) {
    int64_t left = at->row_len - at->col;
    return (int)(left < at->block ? left : at->block);
}

/* The current block's first code byte at ``bits`` bits: its row's first byte plus its column's. */
static inline int64_t rows_code_byte(const rows_t *at, int bits) {
    return at->row * ((at->row_len * bits + 7) / 8) + at->col * bits / 8;
}

/* The elements [first, end) that blocks [b0, b1) cover (b0 < b1): consecutive blocks are consecutive. */
static inline void rows_span(int64_t row_len, int64_t block, int64_t b0, int64_t b1, int64_t *first, int64_t *end) {
    rows_t a = rows_at(row_len, block, b0), z = rows_at(row_len, block, b1 - 1);
    *first = rows_offset(&a);
    *end = rows_offset(&z) + rows_len(&z);
}


/* Quantize blocks [b0, b1) of one width (always inlined with it and the encoder's switches constant:
 * encode_prepared's loop then has no branch on them). An fp32 source without the transform is encoded
 * where it lies; others go through buf. */
static inline __attribute__((always_inline)) void quantize_blocks(
        const void *src, int dtype, int64_t row_len, int64_t block, int64_t b0, int64_t b1, int sqrt_transform,
        const vencode_t *e, uint8_t *codes, float *absmax, int bits) {
    float buf[block];  /* C99 VLA: a block's values, at most 16 KB */
    rows_t at = rows_at(row_len, block, b0);
    for (int64_t b = b0; b < b1; b++, rows_next(&at)) {
        const int len = rows_len(&at);
        const int64_t off = rows_offset(&at);
        const float *x = buf;
        if (dtype == F32 && !sqrt_transform)
            x = (const float *)src + off;
        else
            load_block(src, off, len, dtype, sqrt_transform, buf);
        const float scale = absmax[b] = block_absmax(x, len);
        encode_prepared(e, x, len, scale, codes + rows_code_byte(&at, bits), bits, 0, 0);
    }
}

/* Quantize blocks [b0, b1) of src (dtype F32/BF16/F16; rows of row_len) into codes and absmax, the
 * whole tensor's (the row layout addresses each block). table: the code table (int32 [65536]); thr15:
 * the thresholds (fp32 [2**bits - 1]) for 4 and 2 bits, or NULL (then the code table serves them too). */
int ckq_quantize(const void *src, int dtype, int64_t row_len, int64_t block, int64_t b0, int64_t b1,
                  int sqrt_transform, const int32_t *table, uint8_t *codes, float *absmax, int bits,
                  const float *thr15) {
    if (BAD_BLOCK(block) || BAD_BITS(bits, block) || row_len < 1 || (unsigned)dtype > F16) return -1;
    vencode_t e;  /* prepared once per width, with the thresholds or without (both constant where it is inlined) */
#define QUANTIZE_WITH(BITS, THR)                                                                            \
    do {                                                                                                    \
        vencode_init(&e, table + 32768, THR, 0, BITS);                                                      \
        quantize_blocks(src, dtype, row_len, block, b0, b1, sqrt_transform, &e, codes, absmax, BITS);       \
    } while (0)
#define QUANTIZE_CASE(BITS)                                                                                 \
    case BITS:                                                                                              \
        if (BITS <= 4 && thr15)                                                                             \
            QUANTIZE_WITH(BITS, thr15);                                                                     \
        else                                                                                                \
            QUANTIZE_WITH(BITS, 0);                                                                         \
        break;
    switch (bits) {
        QUANTIZE_CASE(8)
        QUANTIZE_CASE(6)
        QUANTIZE_CASE(4)
        QUANTIZE_CASE(2)
    }
#undef QUANTIZE_CASE
#undef QUANTIZE_WITH
    return 0;
}

/* Fault in the pages of [p, p + bytes) for writing in one call (Linux 5.14+; a no-op elsewhere or on
 * error). On freshly mapped output this is measurably faster than faulting page by page from the loop:
 * with 2 MB pages 16 MB of output went from 12 to 9 ms on 2 threads (tools/bench/codec.py). */
static void prefault(void *p, int64_t bytes) {
#ifdef __linux__
    uintptr_t start = (uintptr_t)p & ~(uintptr_t)4095, end = ((uintptr_t)p + (uintptr_t)bytes + 4095) & ~(uintptr_t)4095;
    madvise((void *)start, end - start, 23 /* MADV_POPULATE_WRITE */);
#else
    (void)p; (void)bytes;
#endif
}

/* Dequantize blocks [b0, b1) of one width, squared or not (always inlined with both constant). */
static inline __attribute__((always_inline)) void dequantize_blocks(
        const uint8_t *codes, const float *absmax, const vdecode_t *d, int64_t row_len, int64_t block, int64_t b0,
        int64_t b1, float *out, int bits, int square) {
    rows_t at = rows_at(row_len, block, b0);
    for (int64_t b = b0; b < b1; b++, rows_next(&at))
        decode_block(d, codes + rows_code_byte(&at, bits), rows_len(&at), bits, absmax[b], square,
                     out + rows_offset(&at));
}

/* out[i] = qmap[code i] * absmax[i's block] for the elements of blocks [b0, b1) (rows of row_len), then
 * squared for the sqrt transform; fresh_out: out is newly mapped memory, prefault their span. qmap: 256
 * entries (a smaller codebook padded). */
int ckq_dequantize(const uint8_t *codes, const float *absmax, const float *qmap, int64_t row_len, int64_t block,
                    int64_t b0, int64_t b1, int sqrt_transform, float *out, int fresh_out, int bits) {
    if (BAD_BLOCK(block) || BAD_BITS(bits, block) || row_len < 1) return -1;
    if (b0 >= b1) return 0;
    if (fresh_out) {
        int64_t first, end;
        rows_span(row_len, block, b0, b1, &first, &end);
        prefault(out + first, (end - first) * 4);
    }
    vdecode_t d;  /* with VBMI: the codebook's byte planes, 1 KB */
    vdecode_init(&d, qmap, bits);
#define DEQUANTIZE_CASE(BITS)                                                                               \
    case BITS:                                                                                              \
        if (sqrt_transform)                                                                                 \
            dequantize_blocks(codes, absmax, &d, row_len, block, b0, b1, out, BITS, 1);                     \
        else                                                                                                \
            dequantize_blocks(codes, absmax, &d, row_len, block, b0, b1, out, BITS, 0);                     \
        break;
    switch (bits) {
        DEQUANTIZE_CASE(8)
        DEQUANTIZE_CASE(6)
        DEQUANTIZE_CASE(4)
        DEQUANTIZE_CASE(2)
    }
#undef DEQUANTIZE_CASE
    return 0;
}

/* ---- The one step of every optimizer (step.h; its rules: step_rules.h) ----
 * (tests/kernels/simd_driver.c compiles the codec above alone, with CKQ_CODEC_ONLY: the steps take most of the
 * compile time, and it builds for many targets; tests/kernels/step_driver.c builds the steps for the same targets.) */
#ifndef CKQ_CODEC_ONLY
#include "step.h"
#endif
