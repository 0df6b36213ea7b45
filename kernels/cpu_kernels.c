/* ckptq CPU kernels: blockwise 8-, 6-, 4- and 2-bit quantize / dequantize, the fused low-bit Adam step and
 * the one-state step (SGD, Lion, Muon), one parameter or a group of many at a time.
 *
 * Plain C99 with no Python or torch headers, compiled on first use by ckptq/kernels/native.py
 * (`cc -O3 -march=native -ffp-contract=off -fno-math-errno`) and called through ctypes, which releases
 * the GIL: the Python side (backend_native.py) runs the calls on a thread pool, each on a range of blocks,
 * or, for the step, each taking work items from a shared counter.
 *
 * Vector code: quantize, dequantize and every encode (the steps' too) are built on the SIMD layer (simd.h:
 * the instruction set the build targets, AVX-512, AVX2, aarch64 NEON or scalar C, each in a header of its
 * own, and the codec's blocks written once over them). The fused steps' own math has 16-lane AVX-512
 * loops (under VEC, below) and runs as scalar C elsewhere.
 *
 * Every function here equals a PyTorch reference bit for bit, on every path (tests/test_native*.py, and
 * tests/test_simd_driver.py for the builds this machine cannot load, aarch64 ones under qemu):
 *   ckq_quantize           <-> ckptq.kernels.backend_torch.quantize (reference_codes after the transform)
 *   ckq_dequantize         <-> ckptq.kernels.backend_torch.dequantize
 *   ckq_adam_step_group    <-> ckptq.kernels.backend_torch.adam_step (step_rows) of each member in turn
 *   ckq_adam_dense_group   <-> ckptq.kernels.backend_torch.adam_dense_step (adam_math) of each member
 *   ckq_momentum_step_group <-> ckptq.kernels.momentum_torch.momentum_step (SGD, Lion, Muon) of each member
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
 * per moment (the 4-bit budget stores the ratio in 6 bits and sqrt(v) in 2).
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
 * with 2 MB pages 16 MB of output went from 12 to 9 ms on 2 threads (tools/bench_codec.py). */
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

/* ---- The fused steps ----
 * (tests/simd_driver.c compiles the codec above alone, with CKQ_CODEC_ONLY: the steps below take most of
 * the compile time, and it runs a build per target.) */
#ifndef CKQ_CODEC_ONLY

/* Hyperparameters, fp32 [10] per member, in ckptq.kernels.contract.HYPER_FIELDS order. */
enum { DECAY, L2, OMB1, BETA2, OMB2, EPS, NEG_STEP, BC2_SQRT, DECODE_EPS, ENCODE_EPS };

/* The Adam(W) update in backend_torch.adam_math's order, one element: gi = (maximize ? -g : g) + l2 * p,
 * m += omb1 * (gi - m) (torch's lerp), v = v * beta2 + omb2 * (gi * gi). */
static inline void moments1(const float *h, int maximize, float g, float p, float *m, float *v) {
    float gi = (maximize ? -g : g) + h[L2] * p;
    *m = *m + h[OMB1] * (gi - *m);
    *v = *v * h[BETA2] + h[OMB2] * (gi * gi);
}

/* torch.maximum: NaN where either is. */
static inline float maximum1(float a, float b) { return (a != a || b != b) ? NAN : (a > b ? a : b); }

/* The new param from the new m and root = sqrt(v) (or sqrt(vmax)): p * decay + neg_step * (m / denom). */
static inline float param1(const float *h, float p, float m, float root) {
    float denom = root / h[BC2_SQRT] + h[EPS];
    return p * h[DECAY] + h[NEG_STEP] * (m / denom);
}

#if VEC
/* Scalars of the step broadcast to 16 lanes, and its switches. */
typedef struct {
    __m512 dec_eps, l2, omb1, beta2, omb2, bc2_sqrt, eps, decay, neg_step, enc_eps;
    int ratio, maximize, amsgrad;
} vstep_t;

static inline vstep_t vstep_init(const float *h, int ratio, int maximize, int amsgrad) {
    vstep_t k = {_mm512_set1_ps(h[DECODE_EPS]), _mm512_set1_ps(h[L2]), _mm512_set1_ps(h[OMB1]),
                 _mm512_set1_ps(h[BETA2]), _mm512_set1_ps(h[OMB2]), _mm512_set1_ps(h[BC2_SQRT]),
                 _mm512_set1_ps(h[EPS]), _mm512_set1_ps(h[DECAY]), _mm512_set1_ps(h[NEG_STEP]),
                 _mm512_set1_ps(h[ENCODE_EPS]), ratio, maximize, amsgrad};
    return k;
}

/* moments1, maximum1 and param1 on 16 lanes. */
static inline void moments16(const vstep_t *k, __m512 g, __m512 p, __m512 *m, __m512 *v) {
    if (k->maximize) g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN)));
    __m512 gi = _mm512_add_ps(g, _mm512_mul_ps(k->l2, p));
    *m = _mm512_add_ps(*m, _mm512_mul_ps(k->omb1, _mm512_sub_ps(gi, *m)));
    *v = _mm512_add_ps(_mm512_mul_ps(*v, k->beta2), _mm512_mul_ps(k->omb2, _mm512_mul_ps(gi, gi)));
}

static inline __m512 maximum16(__m512 a, __m512 b) {
    __mmask16 nan = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(_mm512_max_ps(a, b), nan, _mm512_set1_ps(NAN));
}

static inline __m512 param16(const vstep_t *k, __m512 p, __m512 m, __m512 root) {
    __m512 denom = _mm512_add_ps(_mm512_div_ps(root, k->bc2_sqrt), k->eps);
    return _mm512_add_ps(_mm512_mul_ps(p, k->decay), _mm512_mul_ps(k->neg_step, _mm512_div_ps(m, denom)));
}

/* The quantized step on 16 elements: s = sqrt(v), m (as decoded: a ratio when k->ratio) and, with amsgrad,
 * xs = sqrt(max_exp_avg_sq), all already times their block's absmax. Writes the new param to pf, and the
 * new ratio m / (sqrt(v) + encode_eps), sqrt(v) and sqrt(vmax) to out[0..2] + j for requantization,
 * tracking their block maxima in acc[0..2] (block_absmax's unsigned max on the bits). */
static inline void step16(const vstep_t *k, __m512 s, __m512 m, __m512 xs, const float *gf, float *pf,
                          float *const out[3], int j, __m512i acc[3]) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    if (k->ratio) m = _mm512_mul_ps(m, _mm512_add_ps(s, k->dec_eps));
    __m512 p = _mm512_loadu_ps(pf + j), v = _mm512_mul_ps(s, s);
    moments16(k, _mm512_loadu_ps(gf + j), p, &m, &v);
    __m512 snew = _mm512_sqrt_ps(v), root = snew;
    if (k->amsgrad) {
        root = _mm512_sqrt_ps(maximum16(_mm512_mul_ps(xs, xs), v));
        _mm512_storeu_ps(out[2] + j, root);
        acc[2] = _mm512_max_epu32(acc[2], _mm512_and_si512(_mm512_castps_si512(root), abs_mask));
    }
    _mm512_storeu_ps(pf + j, param16(k, p, m, root));
    __m512 ratio = _mm512_div_ps(m, _mm512_add_ps(snew, k->enc_eps));
    _mm512_storeu_ps(out[0] + j, ratio);
    _mm512_storeu_ps(out[1] + j, snew);
    acc[0] = _mm512_max_epu32(acc[0], _mm512_and_si512(_mm512_castps_si512(ratio), abs_mask));
    acc[1] = _mm512_max_epu32(acc[1], _mm512_and_si512(_mm512_castps_si512(snew), abs_mask));
}
#else
typedef struct { int unused; } vstep_t;  /* no vector loops: the scalar ones read the hyper row */
#endif

/* What all members of a step share (backend_native's StepConfig mirrors it field for field). Moments:
 * 0 exp_avg (m), 1 exp_avg_sq (stored as sqrt(v)), 2 max_exp_avg_sq (amsgrad, stored as sqrt(vmax)). */
typedef struct {
    const float *decode[3];      /* fp32 [256]: the codebook the stored codes refer to (a smaller one padded) */
    const int32_t *table[3];     /* int32 [65536]: code table of the codebook new codes are written on */
    const float *thresholds[3];  /* fp32 [2**bits - 1]: its midpoints (searched in a register at 4 and 2 bits) */
    const float *encode[2];      /* fp32 [2**bits]: m's and v's new codebooks, read by stochastic rounding */
    int32_t bits[3];             /* code width per moment: 8, 6, 4 or 2 */
    int32_t moments;             /* 2, or 3 with amsgrad */
    int32_t block;               /* block size, 1..4096 */
    int32_t ratio;               /* m's stored codes are ratios m / (sqrt(v) + decode_eps), else plain m */
    int32_t maximize;
    int32_t pdtype, gdtype;      /* F32, BF16 or F16 */
} step_config_t;

/* One member: its param and its moments' codes and scales, laid out in rows of row_len (eight 64-bit
 * words: backend_native packs a group's members into one int64 array [members, 8]). */
typedef struct {
    void *p;             /* [n] of config.pdtype, updated in place */
    uint8_t *codes[3];   /* per moment: [rows * row_bytes(bits)], rewritten in place */
    float *absmax[3];    /* per moment: [rows * blocks_per_row], rewritten in place */
    int64_t row_len;
} member_t;

static int bad_config(const step_config_t *c) {
    if (BAD_BLOCK(c->block) || (c->moments != 2 && c->moments != 3)) return 1;
    for (int k = 0; k < c->moments; k++)
        if (BAD_BITS(c->bits[k], c->block)) return 1;
    return (unsigned)c->pdtype > F16 || (unsigned)c->gdtype > F16;
}

/* What a thread derives from the config once per call: code tables at their middle, and the vector
 * loops' codebooks and unpackers per moment (a missing max_exp_avg_sq repeats exp_avg_sq's). */
typedef struct {
    const step_config_t *c;
    const int32_t *table[3];
    int bits[3];  /* code width per moment */
    int same;     /* the moments' common code width, 0 when they differ */
    int amsgrad;
#if VEC
    __m512 q16[3];       /* the first 16 entries of each decode map: 4-bit codebooks in one register */
    unpack_t unpack[3];
    cb_t cb[3];
#endif
#if DECODE64
    planes_t planes[3];
#endif
} step_ctx_t;

static void step_ctx_init(step_ctx_t *x, const step_config_t *c) {
    x->c = c;
    x->amsgrad = c->moments == 3;
    x->same = c->bits[0] == c->bits[1] && (!x->amsgrad || c->bits[2] == c->bits[0]) ? c->bits[0] : 0;
    for (int k = 0; k < 3; k++) {
        int j = k < c->moments ? k : 1;
        x->table[k] = c->table[j] + 32768;
        x->bits[k] = c->bits[j];
#if VEC
        x->q16[k] = _mm512_loadu_ps(c->decode[j]);
        x->unpack[k] = unpack_init(c->bits[j]);
        x->cb[k] = cb_init(c->decode[j], c->bits[j]);
#endif
#if DECODE64
        if (c->bits[j] == 8) planes_init(&x->planes[k], c->decode[j]);
#endif
    }
}

#if VEC
/* Moment k's 16 stored values from element i on, before their scale: codes ``bits`` wide at c, unpacked
 * and looked up in its codebook. */
static inline __m512 decode16(const step_ctx_t *x, int k, const uint8_t *c, int i, int bits) {
    return cb_lookup(&x->cb[k], codes16(&x->unpack[k], c, i, bits), bits);
}
#endif

/* The step's first pass over one block of len elements: decode each moment (codes from c[k], times its
 * scale sc[k]), step each element (grad gf, param pf as fp32, updated in place), and write the new ratio,
 * sqrt(v) and sqrt(vmax) to out[0..2]. mx[k]: the unsigned max of out[k]'s bits with the sign cleared
 * (bits_to_absmax gives the block's new scale). The scalar loop states the math; the vector loops are it
 * on 16 lanes (step16), after decoding 32 4-bit or 64 8-bit codes at once where all moments share that
 * width (``same``), else 16 codes of each width at a time. Always inlined: step_values calls it with
 * constant switches for the common case, whose loop then has no branches on them. */
static inline __attribute__((always_inline)) void step_values(
        const step_ctx_t *x, const vstep_t *scalars, const float *h, const uint8_t *const c[3], const float sc[3],
        const float *gf, float *pf, float *const out[3], int len, uint32_t mx[3], int same, int amsgrad, int ratio,
        int maximize, int m_bits, int v_bits, int x_bits) {
    const step_config_t *cfg = x->c;
    int i = 0;
    mx[0] = mx[1] = mx[2] = 0;
#if VEC
    const vstep_t k = *scalars;  /* the hyper row on 16 lanes, set up once per item */
    const __m512 vma = _mm512_set1_ps(sc[0]), vva = _mm512_set1_ps(sc[1]), vxa = _mm512_set1_ps(sc[2]);
    __m512i acc[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (; same == 4 && i + 32 <= len; i += 32) {
        __m512 sq[2], mq[2], xq[2] = {vxa, vxa};
        decode32_nibbles(c[1] + i / 2, x->q16[1], sq);
        decode32_nibbles(c[0] + i / 2, x->q16[0], mq);
        if (amsgrad) decode32_nibbles(c[2] + i / 2, x->q16[2], xq);
        for (int r = 0; r < 2; r++)
            step16(&k, _mm512_mul_ps(sq[r], vva), _mm512_mul_ps(mq[r], vma),
                   amsgrad ? _mm512_mul_ps(xq[r], vxa) : vxa, gf, pf, out, i + 16 * r, acc);
    }
#if DECODE64
    for (; same == 8 && i + 64 <= len; i += 64) {
        __m512 sq[4], mq[4], xq[4] = {vxa, vxa, vxa, vxa};
        decode64(&x->planes[1], c[1] + i, sq);
        decode64(&x->planes[0], c[0] + i, mq);
        if (amsgrad) decode64(&x->planes[2], c[2] + i, xq);
        for (int r = 0; r < 4; r++)
            step16(&k, _mm512_mul_ps(sq[r], vva), _mm512_mul_ps(mq[r], vma),
                   amsgrad ? _mm512_mul_ps(xq[r], vxa) : vxa, gf, pf, out, i + 16 * r, acc);
    }
#endif
    for (; i + VEC <= len; i += VEC) {  /* any widths, 16 codes each */
        __m512 s = _mm512_mul_ps(decode16(x, 1, c[1], i, v_bits), vva);
        __m512 m = _mm512_mul_ps(decode16(x, 0, c[0], i, m_bits), vma);
        __m512 xs = amsgrad ? _mm512_mul_ps(decode16(x, 2, c[2], i, x_bits), vxa) : vxa;
        step16(&k, s, m, xs, gf, pf, out, i, acc);
    }
    for (int j = 0; j < 3; j++) mx[j] = (uint32_t)_mm512_reduce_max_epu32(acc[j]);
#endif
    for (; i < len; i++) {
        float s = cfg->decode[1][code_at(c[1], i, v_bits)] * sc[1];  /* sqrt(v) as stored */
        float m = cfg->decode[0][code_at(c[0], i, m_bits)] * sc[0];
        if (ratio) m = m * (s + h[DECODE_EPS]);
        float v = s * s, root;
        moments1(h, maximize, gf[i], pf[i], &m, &v);
        float snew = root = sqrtf(v);
        if (amsgrad) {
            float xs = cfg->decode[2][code_at(c[2], i, x_bits)] * sc[2];
            out[2][i] = root = sqrtf(maximum1(xs * xs, v));
        }
        pf[i] = param1(h, pf[i], m, root);
        out[0][i] = m / (snew + h[ENCODE_EPS]);  /* the ratio to the new exact second moment */
        out[1][i] = snew;
        for (int j = 0; j < 2 + amsgrad; j++) {
            uint32_t a = f2u(out[j][i]) & 0x7FFFFFFFu;
            mx[j] = a > mx[j] ? a : mx[j];
        }
    }
}

/* The step's second pass for moment k: the new scale from the block maximum, then the new codes (to
 * nearest, or stochastically from the hashes hb when seeded: m from their high halves, v from the low). */
static void encode_moment(const step_ctx_t *x, int k, const float *values, int len, float absmax, uint8_t *codes,
                          const uint32_t *hb) {
    const float *q = hb && k < 2 ? x->c->encode[k] : 0;  /* max_exp_avg_sq always rounds to nearest */
    const int32_t *table = x->table[k];
    switch (x->bits[k]) {  /* one loop per width (encode_block inlined with it constant) */
    case 8:
        if (!q)
            encode_nearest8(values, len, absmax, table, codes);
        else
            encode_block(values, len, absmax, table, codes, 8, q, hb, k == 0, 0);
        break;
    case 6:
        encode_block(values, len, absmax, table, codes, 6, q, hb, k == 0, 0);
        break;
    case 4:
        encode_block(values, len, absmax, table, codes, 4, q, hb, k == 0, x->c->thresholds[k]);
        break;
    default:
        encode_block(values, len, absmax, table, codes, 2, q, hb, k == 0, x->c->thresholds[k]);
    }
}

/* The step writes each block's new values to scratch and encodes them from there. Written at one place
 * block after block, that scratch can stall the loads in flight whose low 12 address bits match it (the
 * param, the grad, constants spilled to the stack: Intel cores check a load against earlier stores by
 * those bits first, "4K aliasing"): the 6+2-bit step at 4M elements took 5.2 to 6.8 cycles per element
 * depending on where the stack happened to lie. Each block's values go to the next place in a ring of
 * 16 KB instead, so no store place stays fixed: 4.5 to 5.2 over the same layouts (a 4 KB ring did not
 * help). */
#define SCRATCH_RING 4096  /* floats; a power of two */

/* The fused step on blocks [b0, b1) of one member (grad g, hyper row h, seed NULL: to nearest): per
 * block, convert a 16-bit param and grad to fp32, step_values, write the param back, then each moment's
 * new scale and codes. Operation order as backend_torch.step_rows. Always inlined with the switches and
 * widths of step_values (see step_blocks). */
static inline __attribute__((always_inline)) void step_blocks_of(
        const step_ctx_t *x, const member_t *mem, const void *g, const float *h, const int64_t *seed, int64_t b0,
        int64_t b1, int same, int amsgrad, int ratio, int maximize, int m_bits, int v_bits, int x_bits) {
    const step_config_t *c = x->c;
    const int block = c->block, moments = 2 + amsgrad, bits[3] = {m_bits, v_bits, x_bits};
    /* a block each of param, grad and stochastic rounding hashes, and a ring of SCRATCH_RING floats (plus
     * a block) each for the new ratio, sqrt(v) and sqrt(vmax): C99 VLAs, 54 KB at the default block size,
     * 128 KB at 4096 */
    float pb[block], gb[block], ring[3][SCRATCH_RING + block];
    uint32_t hb[block];
    int at_ring = 0;
#if VEC
    const vstep_t k = vstep_init(h, ratio, maximize, amsgrad);
#else
    const vstep_t k = {0};
#endif
    rows_t at = rows_at(mem->row_len, block, b0);
    for (int64_t b = b0; b < b1; b++, rows_next(&at)) {
        const int64_t off = rows_offset(&at);
        const int len = rows_len(&at);
        float *pf = c->pdtype == F32 ? (float *)mem->p + off : pb;  /* fp32 in place, else buffered */
        const float *gf = c->gdtype == F32 ? (const float *)g + off : gb;
        if (c->pdtype != F32) load_block(mem->p, off, len, c->pdtype, 0, pb);
        if (c->gdtype != F32) load_block(g, off, len, c->gdtype, 0, gb);
        at_ring = (at_ring + block) & (SCRATCH_RING - 1);  /* this block's new values: the next place */
        float *const out[3] = {ring[0] + at_ring, ring[1] + at_ring, ring[2] + at_ring};
        uint8_t *codes[3] = {0, 0, 0};
        float scale[3] = {0.0f, 0.0f, 0.0f};
        uint32_t mx[3];
        for (int j = 0; j < moments; j++) {
            codes[j] = mem->codes[j] + rows_code_byte(&at, bits[j]);
            scale[j] = mem->absmax[j][b];
        }
        step_values(x, &k, h, (const uint8_t *const *)codes, scale, gf, pf, out, len, mx, same, amsgrad, ratio,
                    maximize, m_bits, v_bits, x_bits);
        if (c->pdtype != F32) store_block(mem->p, off, len, c->pdtype, pb);
        if (seed) hashes(hb, len, off, (uint32_t)*seed);  /* off: the element's index in the parameter */
        float scale_new[3];
        for (int j = 0; j < moments; j++) mem->absmax[j][b] = scale_new[j] = bits_to_absmax(mx[j]);
        if (same == 8 && !amsgrad && !seed)  /* AdamW8bit's default */
            encode_nearest8_pair(out[0], out[1], len, scale_new[0], scale_new[1], x->table[0], x->table[1], codes[0], codes[1]);
        else
            for (int j = 0; j < moments; j++) encode_moment(x, j, out[j], len, scale_new[j], codes[j], seed ? hb : 0);
    }
}

/* step_blocks_of, compiled apart for the defaults of AdamW8bit (8-bit codes) and AdamW4bit (a 6-bit ratio
 * and a 2-bit sqrt(v)), ratio codes without amsgrad or maximize: with the switches and widths constant
 * the loops carry no branches on them, and what the blocks share is set up once per item. */
static void step_blocks(const step_ctx_t *x, const member_t *mem, const void *g, const float *h,
                        const int64_t *seed, int64_t b0, int64_t b1) {
    const step_config_t *c = x->c;
    const int *w = x->bits, plain = !x->amsgrad && c->ratio && !c->maximize;
    if (plain && x->same == 8)
        step_blocks_of(x, mem, g, h, seed, b0, b1, 8, 0, 1, 0, 8, 8, 8);
    else if (plain && w[0] == 6 && w[1] == 2)
        step_blocks_of(x, mem, g, h, seed, b0, b1, 0, 0, 1, 0, 6, 2, 2);
    else
        step_blocks_of(x, mem, g, h, seed, b0, b1, x->same, x->amsgrad, c->ratio, c->maximize, w[0], w[1], w[2]);
}

/* The fused step of a group of parameters (one call per thread; all threads of a call share ``next``,
 * which the caller set to 0). Member i: members[i], its grad at address grads[i] (of config.gdtype), its
 * hyper row hyper[10 i .. 10 i + 9], its seed seeds[i] (seeds NULL: every member rounds to nearest). The
 * work: items[3 j .. 3 j + 2] = (member, first block, end block), taken one at a time from the shared
 * counter, so that threads that finish early take more (hundreds of small members and a few big ones
 * balance alike). Returns -1 for a config the kernels cannot take, else 0. */
int ckq_adam_step_group(const step_config_t *config, const member_t *members, const int64_t *grads,
                         const float *hyper, const int64_t *seeds, const int64_t *items, int64_t n_items,
                         int64_t *next) {
    if (bad_config(config)) return -1;
    step_ctx_t x;
    step_ctx_init(&x, config);
    for (;;) {
        int64_t j = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (j >= n_items) return 0;
        const int64_t *item = items + 3 * j, i = item[0];
        step_blocks(&x, members + i, (const void *)(uintptr_t)grads[i], hyper + 10 * i, seeds ? seeds + i : 0,
                    item[1], item[2]);
    }
}

/* One member of a dense group: its param and its plain fp32 moments (eight bytes each: backend_native
 * packs a group's members into one int64 array [members, 4]). */
typedef struct {
    void *p;      /* [n], updated in place */
    float *m, *v;
    float *vmax;  /* NULL without amsgrad */
} dense_member_t;

#define DENSE_CHUNK 1024  /* elements per pass: 16-bit params and grads go through fp32 buffers of this size */

/* adam_math on elements [0, len) of one member's chunk: p, g fp32 (p in place), its moments at m, v, vmax. */
static void dense_chunk(const float *h, int maximize, float *p, const float *g, float *m, float *v, float *vmax,
                        int len) {
    int i = 0;
#if VEC
    const vstep_t k = vstep_init(h, 0, maximize, vmax != 0);
    for (; i + VEC <= len; i += VEC) {
        __m512 pi = _mm512_loadu_ps(p + i), mi = _mm512_loadu_ps(m + i), vi = _mm512_loadu_ps(v + i);
        moments16(&k, _mm512_loadu_ps(g + i), pi, &mi, &vi);
        __m512 root_of = vi;
        if (vmax) {
            root_of = maximum16(_mm512_loadu_ps(vmax + i), vi);
            _mm512_storeu_ps(vmax + i, root_of);
        }
        _mm512_storeu_ps(p + i, param16(&k, pi, mi, _mm512_sqrt_ps(root_of)));
        _mm512_storeu_ps(m + i, mi);
        _mm512_storeu_ps(v + i, vi);
    }
#endif
    for (; i < len; i++) {
        float mi = m[i], vi = v[i];
        moments1(h, maximize, g[i], p[i], &mi, &vi);
        float root_of = vi;
        if (vmax) root_of = vmax[i] = maximum1(vmax[i], vi);
        p[i] = param1(h, p[i], mi, sqrtf(root_of));
        m[i] = mi;
        v[i] = vi;
    }
}

/* The Adam(W) step of parameters with plain fp32 moments (backend_torch.adam_dense_step of each), one
 * call per thread sharing ``next`` as ckq_adam_step_group does; items[3 j .. 3 j + 2] = (member, first
 * element, end element). Returns -1 for a dtype the kernels cannot take, else 0. */
int ckq_adam_dense_group(const dense_member_t *members, const int64_t *grads, const float *hyper,
                          const int64_t *items, int64_t n_items, int64_t *next, int pdtype, int gdtype,
                          int maximize) {
    if ((unsigned)pdtype > F16 || (unsigned)gdtype > F16) return -1;
    float pb[DENSE_CHUNK], gb[DENSE_CHUNK];
    for (;;) {
        int64_t j = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (j >= n_items) return 0;
        const int64_t *item = items + 3 * j;
        const dense_member_t *d = members + item[0];
        const void *g = (const void *)(uintptr_t)grads[item[0]];
        for (int64_t off = item[1]; off < item[2]; off += DENSE_CHUNK) {
            int len = (int)(item[2] - off < DENSE_CHUNK ? item[2] - off : DENSE_CHUNK);
            float *pf = pdtype == F32 ? (float *)d->p + off : pb;
            const float *gf = gdtype == F32 ? (const float *)g + off : gb;
            if (pdtype != F32) load_block(d->p, off, len, pdtype, 0, pb);
            if (gdtype != F32) load_block(g, off, len, gdtype, 0, gb);
            dense_chunk(hyper + 10 * item[0], maximize, pf, gf, d->m + off, d->v + off, d->vmax ? d->vmax + off : 0, len);
            if (pdtype != F32) store_block(d->p, off, len, pdtype, pb);
        }
    }
}

/* ---- The one-state step (SGD, Lion, Muon: momentum_torch.momentum_step) ----
 *
 * Per element, fp32, each operation rounded once in this order (ckptq.kernels.contract.MOMENTUM_FIELDS):
 * gi = (maximize ? -g : g) + l2 * p; m = qmap[code] * absmax; m_new = m * keep + take * gi;
 * d = (m * c_old + m_new * c_new) + gi * c_grad; then p = p * decay + neg_lr * d (UPDATE_LINEAR) or
 * p * decay + neg_lr * sign(d) (UPDATE_SIGN; sign(+-0) = +0, sign(NaN) = NaN), or p untouched
 * (UPDATE_NONE); d written to out where the caller passes one. m_new is requantized per block as the Adam
 * step's moments are (encode_block; stochastically from the hash's high half when seeded). */

enum { M_L2, M_KEEP, M_TAKE, M_C_OLD, M_C_NEW, M_C_GRAD, M_DECAY, M_NEG_LR };
enum { UPDATE_NONE = 0, UPDATE_LINEAR = 1, UPDATE_SIGN = 2 };

/* What all members of a one-state step share (native.MomentumConfig mirrors it field for field). */
typedef struct {
    const float *decode;      /* fp32 [256]: the codebook the stored codes refer to (a smaller one padded) */
    const int32_t *table;     /* int32 [65536]: code table of the codebook new codes are written on */
    const float *thresholds;  /* fp32 [2**bits - 1]: its midpoints */
    const float *encode;      /* fp32 [2**bits]: that codebook (stochastic rounding reads it) */
    int32_t bits, block, maximize, update, pdtype, gdtype;
} momentum_config_t;

static int bad_momentum_config(const momentum_config_t *c) {
    return BAD_BLOCK(c->block) || BAD_BITS(c->bits, c->block) || (unsigned)c->update > UPDATE_SIGN ||
           (unsigned)c->pdtype > F16 || (unsigned)c->gdtype > F16;
}

/* sign(d) as the contract has it: -1, +0 or 1, NaN for NaN. */
static inline float sign1(float d) { return d != d ? d : (float)((d > 0.0f) - (d < 0.0f)); }

#if VEC
static inline __m512 sign16(__m512 d) {
    const __m512 zero = _mm512_setzero_ps();
    __m512 s = _mm512_mask_mov_ps(zero, _mm512_cmp_ps_mask(d, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
    s = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(d, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
    return _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q), d);
}
#endif

#if VEC
/* The hyper row on 16 lanes. */
typedef struct { __m512 l2, keep, take, c_old, c_new, c_grad, decay, neg_lr; } vmomentum_t;

static inline vmomentum_t vmomentum_init(const float *h) {
    vmomentum_t k = {_mm512_set1_ps(h[M_L2]), _mm512_set1_ps(h[M_KEEP]), _mm512_set1_ps(h[M_TAKE]),
                     _mm512_set1_ps(h[M_C_OLD]), _mm512_set1_ps(h[M_C_NEW]), _mm512_set1_ps(h[M_C_GRAD]),
                     _mm512_set1_ps(h[M_DECAY]), _mm512_set1_ps(h[M_NEG_LR])};
    return k;
}

/* The step on elements j .. j + 15 from the decoded state m (times its scale): the scalar loop of
 * momentum_values on 16 lanes; acc tracks the unsigned max of m_new's bits with the sign cleared. */
static inline __attribute__((always_inline)) void momentum16(const vmomentum_t *k, __m512 m, const float *gf,
                                                             float *pf, float *mn, float *out, int j, __m512i *acc,
                                                             int maximize, int update) {
    __m512 p = _mm512_loadu_ps(pf + j), g = _mm512_loadu_ps(gf + j);
    if (maximize) g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN)));
    __m512 gi = _mm512_add_ps(g, _mm512_mul_ps(k->l2, p));
    __m512 m_new = _mm512_add_ps(_mm512_mul_ps(m, k->keep), _mm512_mul_ps(k->take, gi));
    __m512 d = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(m, k->c_old), _mm512_mul_ps(m_new, k->c_new)),
                             _mm512_mul_ps(gi, k->c_grad));
    if (update != UPDATE_NONE)
        _mm512_storeu_ps(pf + j, _mm512_add_ps(_mm512_mul_ps(p, k->decay),
                                               _mm512_mul_ps(k->neg_lr, update == UPDATE_SIGN ? sign16(d) : d)));
    if (out) _mm512_storeu_ps(out + j, d);
    _mm512_storeu_ps(mn + j, m_new);
    *acc = _mm512_max_epu32(*acc, _mm512_and_si512(_mm512_castps_si512(m_new), _mm512_set1_epi32(0x7FFFFFFF)));
}
#endif

#if DECODE64
typedef planes_t momentum_planes_t;
#else
typedef int momentum_planes_t;  /* unused */
#endif

/* One block of len elements: decode the state (codes c, scale sc), step each element (param pf in place
 * unless UPDATE_NONE, grad gf), m_new to mn, d to out (NULL: not written). Returns the unsigned max of
 * m_new's bits with the sign cleared (bits_to_absmax gives the new scale). 8-bit codes decode 64 at a
 * time by byte permutes where the CPU has VBMI (planes: the decode map's byte planes), else 16 at a time.
 * Always inlined with constant widths and switches (momentum_blocks). */
static inline __attribute__((always_inline)) uint32_t momentum_values(
        const momentum_config_t *cfg, const float *h, const momentum_planes_t *planes, const uint8_t *c, float sc,
        const float *gf, float *pf, float *mn, float *out, int len, int bits, int maximize, int update) {
    uint32_t mx = 0;
    int i = 0;
    (void)planes;
#if VEC
    const vmomentum_t k = vmomentum_init(h);
    const __m512 vsc = _mm512_set1_ps(sc);
    __m512i acc = _mm512_setzero_si512();
#if DECODE64
    for (; bits == 8 && i + 64 <= len; i += 64) {
        __m512 q[4];
        decode64(planes, c + i, q);
        for (int r = 0; r < 4; r++)
            momentum16(&k, _mm512_mul_ps(q[r], vsc), gf, pf, mn, out, i + 16 * r, &acc, maximize, update);
    }
#endif
    {
        const unpack_t u = unpack_init(bits);
        const cb_t cb = cb_init(cfg->decode, bits);
        for (; i + VEC <= len; i += VEC)
            momentum16(&k, _mm512_mul_ps(cb_lookup(&cb, codes16(&u, c, i, bits), bits), vsc), gf, pf, mn, out, i,
                       &acc, maximize, update);
    }
    mx = (uint32_t)_mm512_reduce_max_epu32(acc);
#endif
    for (; i < len; i++) {
        float m = cfg->decode[code_at(c, i, bits)] * sc;
        float gi = (maximize ? -gf[i] : gf[i]) + h[M_L2] * pf[i];
        float m_new = m * h[M_KEEP] + h[M_TAKE] * gi;
        float d = (m * h[M_C_OLD] + m_new * h[M_C_NEW]) + gi * h[M_C_GRAD];
        if (update != UPDATE_NONE) pf[i] = pf[i] * h[M_DECAY] + h[M_NEG_LR] * (update == UPDATE_SIGN ? sign1(d) : d);
        if (out) out[i] = d;
        mn[i] = m_new;
        uint32_t a = f2u(m_new) & 0x7FFFFFFFu;
        mx = a > mx ? a : mx;
    }
    return mx;
}

/* The one-state step on blocks [b0, b1) of one member (grad g, out NULL or fp32 [n], hyper row h, seed
 * NULL: to nearest). Operation order as momentum_torch._momentum_span. */
static inline __attribute__((always_inline)) void momentum_blocks_of(
        const momentum_config_t *c, const member_t *mem, const void *g, float *out, const float *h,
        const int64_t *seed, int64_t b0, int64_t b1, int bits, int maximize, int update) {
    const int block = c->block;
    const int32_t *table = c->table + 32768;
    /* C99 VLAs: a block each of param, grad, hashes; m_new in a ring (SCRATCH_RING: no fixed store place) */
    float pb[block], gb[block], ring[SCRATCH_RING + block];
    uint32_t hb[block];
    int at_ring = 0;
    momentum_planes_t planes;
#if DECODE64
    if (bits == 8) planes_init(&planes, c->decode);
#endif
    rows_t at = rows_at(mem->row_len, block, b0);
    for (int64_t b = b0; b < b1; b++, rows_next(&at)) {
        const int64_t off = rows_offset(&at);
        const int len = rows_len(&at);
        float *pf = c->pdtype == F32 ? (float *)mem->p + off : pb;
        const float *gf = c->gdtype == F32 ? (const float *)g + off : gb;
        if (c->pdtype != F32) load_block(mem->p, off, len, c->pdtype, 0, pb);
        if (c->gdtype != F32) load_block(g, off, len, c->gdtype, 0, gb);
        uint8_t *codes = mem->codes[0] + rows_code_byte(&at, bits);
        at_ring = (at_ring + block) & (SCRATCH_RING - 1);
        float *mn = ring + at_ring;
        uint32_t mx = momentum_values(c, h, &planes, codes, mem->absmax[0][b], gf, pf, mn, out ? out + off : 0, len,
                                      bits, maximize, update);
        if (c->pdtype != F32 && update != UPDATE_NONE) store_block(mem->p, off, len, c->pdtype, pb);
        const float absmax = mem->absmax[0][b] = bits_to_absmax(mx);
        if (seed) {
            hashes(hb, len, off, (uint32_t)*seed);  /* off: the element's index in the parameter */
            encode_block(mn, len, absmax, table, codes, bits, c->encode, hb, 1, bits <= 4 ? c->thresholds : 0);
        } else if (bits == 8) {
            encode_nearest8(mn, len, absmax, table, codes);
        } else {
            encode_block(mn, len, absmax, table, codes, bits, 0, 0, 0, bits <= 4 ? c->thresholds : 0);
        }
    }
}

/* momentum_blocks_of with the width and switches constant (each case compiled on its own). */
static void momentum_blocks(const momentum_config_t *c, const member_t *mem, const void *g, float *out,
                            const float *h, const int64_t *seed, int64_t b0, int64_t b1) {
#define MOMENTUM_CASE(BITS)                                                                                   \
    case BITS:                                                                                                \
        if (c->maximize)                                                                                      \
            momentum_blocks_of(c, mem, g, out, h, seed, b0, b1, BITS, 1, c->update);                          \
        else if (c->update == UPDATE_LINEAR)                                                                  \
            momentum_blocks_of(c, mem, g, out, h, seed, b0, b1, BITS, 0, UPDATE_LINEAR);                      \
        else if (c->update == UPDATE_SIGN)                                                                    \
            momentum_blocks_of(c, mem, g, out, h, seed, b0, b1, BITS, 0, UPDATE_SIGN);                        \
        else                                                                                                  \
            momentum_blocks_of(c, mem, g, out, h, seed, b0, b1, BITS, 0, UPDATE_NONE);                        \
        break;
    switch (c->bits) {
        MOMENTUM_CASE(8)
        MOMENTUM_CASE(6)
        MOMENTUM_CASE(4)
        MOMENTUM_CASE(2)
    }
#undef MOMENTUM_CASE
}

/* The one-state step of a group of parameters (one call per thread, sharing ``next`` as
 * ckq_adam_step_group does). Member i: members[i] (codes[0], absmax[0] its state), its grad at address
 * grads[i], its out at outs[i] (outs NULL: none written), hyper row hyper[8 i .. 8 i + 7], seed seeds[i]
 * (seeds NULL: to nearest). items[3 j .. 3 j + 2] = (member, first block, end block). Returns -1 for a
 * config the kernels cannot take, else 0. */
int ckq_momentum_step_group(const momentum_config_t *config, const member_t *members, const int64_t *grads,
                            const int64_t *outs, const float *hyper, const int64_t *seeds, const int64_t *items,
                            int64_t n_items, int64_t *next) {
    if (bad_momentum_config(config)) return -1;
    for (;;) {
        int64_t j = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (j >= n_items) return 0;
        const int64_t *item = items + 3 * j, i = item[0];
        momentum_blocks(config, members + i, (const void *)(uintptr_t)grads[i],
                        outs ? (float *)(uintptr_t)outs[i] : 0, hyper + 8 * i, seeds ? seeds + i : 0, item[1], item[2]);
    }
}

#endif /* CKQ_CODEC_ONLY */
