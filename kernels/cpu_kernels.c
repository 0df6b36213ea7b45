/* ckptq CPU kernels: blockwise 8-, 6-, 4- and 2-bit quantize / dequantize, the fused low-bit Adam step and
 * the one-state step (SGD, Lion, Muon), one parameter or a group of many at a time.
 *
 * Plain C99 with no Python or torch headers, compiled on first use by ckptq/kernels/native.py
 * (`cc -O3 -march=native -ffp-contract=off -fno-math-errno`) and called through ctypes, which releases
 * the GIL: the Python side (backend_native.py) runs the calls on a thread pool, each on a range of blocks,
 * or, for the step, each taking work items from a shared counter. Where the CPU has AVX-512 (and VBMI)
 * the hot loops use intrinsics; scalar C does the rest and runs everywhere else.
 *
 * Every function here equals a PyTorch reference bit for bit (tests/test_native*.py):
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
#ifdef __AVX512F__
#include <immintrin.h>
#define VEC 16  /* fp32 lanes of the AVX-512 loops; the scalar loops finish what is left */
#else
#define VEC 0
#endif

#define MAX_BLOCK 4096  /* the largest block size; the exported functions return -1 for others */
#define BAD_BLOCK(block) ((block) < 1 || (block) > MAX_BLOCK)
/* code widths 8, 6, 4, 2; a block must start on a byte: a multiple of 4 codes (2 for 4 bits) */
#define BAD_BITS(bits, block) (((bits) != 8 && (bits) != 6 && (bits) != 4 && (bits) != 2) || \
                               ((bits) != 8 && (block) % ((bits) == 4 ? 2 : 4)))

enum { F32 = 0, BF16 = 1, F16 = 2 };

/* Type punning through a union (defined behaviour in C99 and what gcc vectorizes; memcpy here was not). */
typedef union { float f; uint32_t u; } pun_t;
static inline uint32_t f2u(float f) { pun_t p; p.f = f; return p.u; }
static inline float u2f(uint32_t u) { pun_t p; p.u = u; return p.f; }

static inline float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

/* Round to nearest even, NaN -> 0x7FC0: c10::BFloat16's conversion, which torch's copy_ uses. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f2u(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* IEEE binary16 <-> binary32 with round to nearest even (what torch's fp16 conversion does). */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0x1F) return u2f(sign | 0x7F800000u | (man << 13));
    if (exp != 0) return u2f(sign | ((exp + 112) << 23) | (man << 13));
    /* zero or subnormal: man * 2^-24, exact in fp32 */
    float v = (float)man * 5.9604644775390625e-08f;
    return sign ? -v : v;
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t u = f2u(f), sign = (u >> 16) & 0x8000, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00 | ((a >> 13) & 0x3FF));  /* NaN, stays NaN */
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00);  /* rounds to >= 65520: inf */
    if (a < 0x38800000u) {  /* below 2^-14: subnormal half, round man * 2^-24 to an integer, RNE */
        float v = u2f(a) * 16777216.0f;  /* exact: a power-of-two scale of a value < 2^-14 */
        float r = nearbyintf(v);  /* default rounding mode: to nearest even */
        return (uint16_t)(sign | (uint16_t)r);
    }
    uint32_t m = a + 0xC8000FFFu + ((a >> 13) & 1u);  /* rebias exponent (-112 << 23) and round */
    return (uint16_t)(sign | (m >> 13));
}

static inline float load_value(const void *p, int64_t i, int dtype) {
    if (dtype == F32) return ((const float *)p)[i];
    if (dtype == BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return f16_to_f32(((const uint16_t *)p)[i]);
}

/* buf[i] = src[off + i] as fp32 (sqrt applied when asked): a loop per dtype, so each vectorizes. */
static void load_block(const void *src, int64_t off, int len, int dtype, int sqrt_transform, float *buf) {
    if (dtype == F32) {
        const float *s = (const float *)src + off;
        for (int i = 0; i < len; i++) buf[i] = s[i];
    } else if (dtype == BF16) {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int i = 0; i < len; i++) buf[i] = bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int i = 0; i < len; i++) buf[i] = f16_to_f32(s[i]);
    }
    if (sqrt_transform)
        for (int i = 0; i < len; i++) buf[i] = sqrtf(buf[i]);
}

/* max |x| of a block, NaN if any element is NaN (as torch's amax). On the bit patterns with the sign
 * cleared, integer order is value order for non-NaN floats and every NaN lies above +inf, so an
 * unsigned max does both at once and vectorizes. -0.0 gives +0.0, as abs().amax() does. */
static inline float block_absmax(const float *x, int len) {
    uint32_t mx = 0;
    for (int i = 0; i < len; i++) {
        uint32_t a = f2u(x[i]) & 0x7FFFFFFFu;
        mx = a > mx ? a : mx;
    }
    return mx > 0x7F800000u ? NAN : u2f(mx);
}

/* The absmax that block_absmax gives, from the unsigned max of the bit patterns with the sign cleared. */
static inline float bits_to_absmax(uint32_t mx) { return mx > 0x7F800000u ? NAN : u2f(mx); }


/* The code table's answer for one y (see the header): #{t < y}. ``table`` points at the table's middle
 * entry (bucket 0), so the signed top 16 bits index it directly. */
static inline int nearest1(float y, const int32_t *table) {
    int32_t ybits = (int32_t)f2u(y);
    uint32_t e = (uint32_t)table[ybits >> 16];
    uint32_t rank = (uint32_t)(ybits ^ (ybits >> 31)) & 0xFFFFu;  /* negative floats: larger bits, smaller value */
    return (int)((e + rank) >> 17);
}

/* Code c of element i into the bit stream (elements written in order from a byte boundary: the first
 * write to a byte assigns it, so bits past the last code stay 0). */
static inline void put_code(uint8_t *codes, int i, int c, int bits) {
    if (bits == 8) {
        codes[i] = (uint8_t)c;
        return;
    }
    int bit = i * bits, k = bit >> 3, sh = bit & 7;
    if (sh == 0)
        codes[k] = (uint8_t)c;
    else
        codes[k] |= (uint8_t)(c << sh);
    if (sh + bits > 8) codes[k + 1] = (uint8_t)(c >> (8 - sh));
}

/* ckptq.kernels.contract.mix32: the stochastic rounding's hash. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

/* The uniform in [0, 1) of one half of hash h (ckptq.kernels.contract): the first moment takes the high
 * 16 bits (high = 1), the second the low 16. A 16-bit integer times 2^-16: exact. */
static inline float uniform1(uint32_t h, int high) { return (float)(high ? h >> 16 : h & 0xFFFFu) * 0x1p-16f; }

/* Stochastic rounding of y (nearest code c) on the codebook q of top + 1 entries with uniform u. */
static inline int stochastic1(float y, int c, const float *q, int top, float u) {
    int lo = c - (y < q[c]);
    if (lo < 0) lo = 0;
    if (lo >= top) return top;
    return lo + (u * (q[lo + 1] - q[lo]) < y - q[lo]);
}

#if VEC
/* nearest1 on 16 lanes: one gather, the rank (the low 16 bits, flipped for negative y) and an add. */
static inline __m512i nearest16(__m512 y, const int32_t *table) {
    __m512i ybits = _mm512_castps_si512(y);
    __m512i e = _mm512_i32gather_epi32(_mm512_srai_epi32(ybits, 16), table, 4);
    /* (ybits ^ (ybits >> 31)) & 0xFFFF in one ternary-logic op (truth table 0x28: (a ^ b) & c) */
    __m512i rank = _mm512_ternarylogic_epi32(ybits, _mm512_srai_epi32(ybits, 31), _mm512_set1_epi32(0xFFFF), 0x28);
    return _mm512_srli_epi32(_mm512_add_epi32(e, rank), 17);
}

/* #{k < top : r[first + k] < y} (strict) or <= y (not strict), for r[first .. first + top - 1] ascending
 * in one register, top = 2**bits - 1 <= 15: a binary search of ``bits`` permutes that probes only those
 * entries, no gather from the 256 KB code table; a NaN y counts top. With the thresholds (first 0,
 * strict) it is the nearest code, as nearest16 gives it; with a codebook's own entries (first 1, not
 * strict) the entry at or below y that stochastic rounding starts from (stochastic16_up). */
static inline __m512i count16_reg(__m512 y, __m512 r, int top, int first, int strict) {
    __m512i pos = _mm512_setzero_si512();
    for (int step = (top + 1) / 2; step >= 1; step >>= 1) {
        __m512 t = _mm512_permutexvar_ps(_mm512_add_epi32(pos, _mm512_set1_epi32(first + step - 1)), r);
        __mmask16 below = strict ? _mm512_cmp_ps_mask(t, y, _CMP_LT_OQ) : _mm512_cmp_ps_mask(t, y, _CMP_LE_OQ);
        pos = _mm512_mask_add_epi32(pos, below, pos, _mm512_set1_epi32(step));
    }
    return _mm512_mask_mov_epi32(pos, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(top));
}

/* Codes of elements i .. i + 15 (i a multiple of 16) into the bit stream: exactly 2 * bits bytes. */
static inline void put_codes16(uint8_t *codes, int i, __m512i code, int bits) {
    uint8_t *p = codes + i * bits / 8;
    if (bits == 8) {
        _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(code));
    } else if (bits == 4) {  /* as 8 qwords c[2k] | c[2k+1] << 32: fold the high dword onto bits 4..7 */
        __m512i pair = _mm512_or_si512(code, _mm512_srli_epi64(code, 28));
        _mm_storel_epi64((__m128i *)p, _mm512_cvtepi64_epi8(pair));
    } else {  /* each 128-bit lane's 4 codes -> one word c0 | c1 << b | c2 << 2b | c3 << 3b (1 or 3 bytes) */
        const int b = bits;
        __m512i w = _mm512_sllv_epi32(code, _mm512_setr_epi32(0, b, 2 * b, 3 * b, 0, b, 2 * b, 3 * b,
                                                              0, b, 2 * b, 3 * b, 0, b, 2 * b, 3 * b));
        w = _mm512_or_si512(w, _mm512_shuffle_epi32(w, (_MM_PERM_ENUM)0xB1));  /* lanes (1, 0, 3, 2) */
        w = _mm512_or_si512(w, _mm512_shuffle_epi32(w, (_MM_PERM_ENUM)0x4E));  /* lanes (2, 3, 0, 1) */
        __m128i words = _mm512_castsi512_si128(_mm512_permutexvar_epi32(
            _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), w));
        if (bits == 2) {
            int32_t four = _mm_cvtsi128_si32(_mm_shuffle_epi8(words, _mm_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1,
                                                                                    -1, -1, -1, -1, -1, -1, -1, -1)));
            memcpy(p, &four, 4);
        } else {
            __m128i twelve = _mm_shuffle_epi8(words, _mm_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14,
                                                                   -1, -1, -1, -1));
            int32_t last = _mm_extract_epi32(twelve, 2);
            _mm_storel_epi64((__m128i *)p, twelve);
            memcpy(p + 8, &last, 4);
        }
    }
}

/* How to unpack 16 codes of one width: each lane's first byte k, k + 1, its shift, the code mask. The
 * functions below take the width as an argument, not from these structs, so that a loop whose widths are
 * constants compiles to one case. */
typedef struct { __m512i k, k1, sh, mask; } unpack_t;

static inline unpack_t unpack_init(int bits) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i bit = _mm512_mullo_epi32(iota, _mm512_set1_epi32(bits));
    __m512i k = _mm512_srli_epi32(bit, 3);
    unpack_t u = {k, _mm512_add_epi32(k, _mm512_set1_epi32(1)), _mm512_and_si512(bit, _mm512_set1_epi32(7)),
                  _mm512_set1_epi32((1 << bits) - 1)};
    return u;
}

/* The codes of elements i .. i + 15 (i a multiple of 16) as int32 lanes; reads only their 2 * bits bytes. */
static inline __m512i codes16(const unpack_t *u, const uint8_t *codes, int i, int bits) {
    const uint8_t *p = codes + i * bits / 8;
    if (bits == 8) return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    __m128i raw = _mm_maskz_loadu_epi8((__mmask16)((1u << (2 * bits)) - 1), p);
#else
    uint8_t tmp[16] = {0};
    memcpy(tmp, p, 2 * bits);
    __m128i raw = _mm_loadu_si128((const __m128i *)tmp);
#endif
    __m512i bytes = _mm512_cvtepu8_epi32(raw);
    __m512i word = _mm512_or_si512(_mm512_permutexvar_epi32(u->k, bytes),
                                   _mm512_slli_epi32(_mm512_permutexvar_epi32(u->k1, bytes), 8));
    return _mm512_and_si512(_mm512_srlv_epi32(word, u->sh), u->mask);
}

/* A codebook for 16-lane lookups: up to 16 entries in r[0], 64 in r[0..3], 256 read from q. */
typedef struct { __m512 r[4]; const float *q; } cb_t;

static inline __attribute__((always_inline)) cb_t cb_init(const float *q, int bits) {
    cb_t cb = {{_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()}, q};
    if (q && bits <= 4) cb.r[0] = _mm512_maskz_loadu_ps((__mmask16)((1u << (1 << bits)) - 1), q);
    if (q && bits == 6)
        for (int j = 0; j < 4; j++) cb.r[j] = _mm512_loadu_ps(q + 16 * j);
    return cb;
}

/* q[idx] for the 16 codes idx of a codebook of 2**bits entries. */
static inline __m512 cb_lookup(const cb_t *cb, __m512i idx, int bits) {
    if (bits <= 4) return _mm512_permutexvar_ps(idx, cb->r[0]);
    if (bits == 6) {
        __m512 lo = _mm512_permutex2var_ps(cb->r[0], idx, cb->r[1]);
        __m512 hi = _mm512_permutex2var_ps(cb->r[2], idx, cb->r[3]);
        return _mm512_mask_mov_ps(lo, _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), hi);
    }
    return _mm512_i32gather_ps(idx, cb->q, 4);
}

static inline __m512i mix32x16(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846CA68Bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* The contract's stochastic rounding on 16 lanes from lo (the entry at or below y, clamped to
 * 0 .. K - 1): lo + 1 with probability (y - q[lo]) / (q[lo + 1] - q[lo]), top stays top. q: the codebook,
 * u: the lanes' uniforms (uniform16). */
static inline __m512i stochastic16_up(__m512 y, __m512i lo, const cb_t *q, __m512 u, int bits) {
    const int top = (1 << bits) - 1;
    const __m512i one = _mm512_set1_epi32(1), vtop = _mm512_set1_epi32(top);
    __mmask16 at_top = _mm512_cmpge_epi32_mask(lo, vtop);
    __m512 q_lo = cb_lookup(q, lo, bits);
    __m512 q_hi = cb_lookup(q, _mm512_min_epi32(_mm512_add_epi32(lo, one), vtop), bits);
    __mmask16 up = _mm512_cmp_ps_mask(_mm512_mul_ps(u, _mm512_sub_ps(q_hi, q_lo)), _mm512_sub_ps(y, q_lo), _CMP_LT_OQ);
    return _mm512_mask_mov_epi32(_mm512_mask_add_epi32(lo, up, lo, one), at_top, vtop);
}

/* stochastic1 on 16 lanes, from the nearest code c. */
static inline __m512i stochastic16(__m512 y, __m512i c, const cb_t *q, __m512 u, int bits) {
    const __m512i one = _mm512_set1_epi32(1);
    __m512i lo = _mm512_mask_sub_epi32(c, _mm512_cmp_ps_mask(y, cb_lookup(q, c, bits), _CMP_LT_OQ), c, one);
    return stochastic16_up(y, _mm512_max_epi32(lo, _mm512_setzero_si512()), q, u, bits);
}

/* uniform1 of 16 hashes. */
static inline __m512 uniform16(const uint32_t *h, int high) {
    __m512i x = _mm512_loadu_si512(h);
    x = high ? _mm512_srli_epi32(x, 16) : _mm512_and_si512(x, _mm512_set1_epi32(0xFFFF));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(x), _mm512_set1_ps(0x1p-16f));
}

#endif

/* h[k] = mix32((i0 + k) mod 2^32 ^ seed) for k < len: the step's stochastic rounding hashes. */
static inline void hashes(uint32_t *h, int len, int64_t i0, uint32_t seed) {
    int k = 0;
#if VEC
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; k + VEC <= len; k += VEC) {
        __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)(i0 + k)), iota);
        _mm512_storeu_si512(h + k, mix32x16(_mm512_xor_si512(idx, _mm512_set1_epi32((int)seed))));
    }
#endif
    for (; k < len; k++) h[k] = mix32((uint32_t)(i0 + k) ^ seed);
}

/* code i = #{t < x[i] / safe} via the code table (see the header; ``table`` at its middle), or for 4 and
 * 2 bits with the thresholds thr15 in a register; codes packed as put_code does. With a codebook q
 * (stochastic rounding, ckptq.kernels.contract), the code is then rounded stochastically instead, with
 * the uniforms of hashes h (their high halves when ``high``). Always inlined, so that callers with
 * constant arguments (encode_nearest8) get a loop without the other cases' branches. */
static inline __attribute__((always_inline)) void encode_block(const float *x, int len, float absmax,
                                                               const int32_t *table, uint8_t *codes, int bits,
                                                               const float *q, const uint32_t *h, int high,
                                                               const float *thr15) {
    const int top = (1 << bits) - 1;
    float safe = absmax > 0.0f ? absmax : 1.0f;  /* NaN > 0 is false: a NaN block divides by 1 */
    int i = 0;
#if VEC
    const __m512 vsafe = _mm512_set1_ps(safe);
    const cb_t cb = cb_init(q, bits);
    const int in_register = bits <= 4 && thr15;
    const __m512 t15 = in_register ? _mm512_maskz_loadu_ps((__mmask16)((1u << top) - 1), thr15) : vsafe;
    for (; i + VEC <= len; i += VEC) {
        __m512 y = _mm512_div_ps(_mm512_loadu_ps(x + i), vsafe);
        __m512i code;
        if (q && bits <= 4)  /* no nearest code needed: for y not NaN the contract's lo = clamp(c - (y <
                              * q[c]), 0, K - 1) is #{j >= 1 : q[j] <= y} (q[c - 1] < y < q[c + 1]); a NaN
                              * counts K - 1, the top code, as the contract's c = K - 1 gives it */
            code = stochastic16_up(y, count16_reg(y, cb.r[0], top, 1, 0), &cb, uniform16(h + i, high), bits);
        else {
            code = in_register ? count16_reg(y, t15, top, 0, 1) : nearest16(y, table);
            if (q) code = stochastic16(y, code, &cb, uniform16(h + i, high), bits);
        }
        put_codes16(codes, i, code, bits);
    }
#endif
    for (; i < len; i++) {  /* the vector loop stops at a multiple of 16: on a byte */
        float y = x[i] / safe;
        int code = nearest1(y, table);
        put_code(codes, i, q ? stochastic1(y, code, q, top, uniform1(h[i], high)) : code, bits);
    }
}

/* encode_block for 8-bit codes rounded to nearest, the common case. */
static void encode_nearest8(const float *x, int len, float absmax, const int32_t *table, uint8_t *codes) {
    encode_block(x, len, absmax, table, codes, 8, 0, 0, 0, 0);
}

/* encode_nearest8 of two blocks in one loop (the step's ratio and sqrt(v), each with its scale and code
 * table): two independent gathers in flight and one loop's overhead instead of two (tools/bench_kernels.py
 * measures the step with it). */
static void encode_nearest8_pair(const float *x0, const float *x1, int len, float absmax0, float absmax1,
                                 const int32_t *table0, const int32_t *table1, uint8_t *codes0, uint8_t *codes1) {
    float safe0 = absmax0 > 0.0f ? absmax0 : 1.0f, safe1 = absmax1 > 0.0f ? absmax1 : 1.0f;
    int i = 0;
#if VEC
    const __m512 vsafe0 = _mm512_set1_ps(safe0), vsafe1 = _mm512_set1_ps(safe1);
    for (; i + VEC <= len; i += VEC) {
        __m512i c0 = nearest16(_mm512_div_ps(_mm512_loadu_ps(x0 + i), vsafe0), table0);
        __m512i c1 = nearest16(_mm512_div_ps(_mm512_loadu_ps(x1 + i), vsafe1), table1);
        _mm_storeu_si128((__m128i *)(codes0 + i), _mm512_cvtepi32_epi8(c0));
        _mm_storeu_si128((__m128i *)(codes1 + i), _mm512_cvtepi32_epi8(c1));
    }
#endif
    for (; i < len; i++) {
        codes0[i] = (uint8_t)nearest1(x0[i] / safe0, table0);
        codes1[i] = (uint8_t)nearest1(x1[i] / safe1, table1);
    }
}


#if VEC
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
/* A 256-entry fp32 codebook split into its four byte planes, 4 x 64 bytes each, for decode64. */
typedef struct { __m512i plane[4][4]; } planes_t;

static inline void planes_init(planes_t *t, const float *qmap) {
    uint8_t bytes[4][256];
    for (int k = 0; k < 256; k++) {
        uint32_t u = f2u(qmap[k]);
        for (int b = 0; b < 4; b++) bytes[b][k] = (uint8_t)(u >> (8 * b));
    }
    for (int b = 0; b < 4; b++)
        for (int q = 0; q < 4; q++) t->plane[b][q] = _mm512_loadu_si512(bytes[b] + 64 * q);
}

/* qmap[codes[0..63]] as four vectors of 16 fp32 (out[r] = elements 16r..16r+15), with byte permutes
 * instead of gathers (a 16-lane gather costs ~12 cycles on Zen 4; this is ~21 one-cycle ops for 64).
 * Each byte plane is looked up with two 128-entry vpermi2b and a blend on the code's top bit; the
 * planes are then interleaved into dwords by unpack within 128-bit lanes, which leaves position
 * 16i + 4r + j of the codes in lane i, dword j of out[r]: so the codes are first permuted to put
 * element 16r + 4i + j there, and out[r] comes out in order. */
static inline void decode64(const planes_t *t, const uint8_t *codes, __m512 out[4]) {
    static const uint8_t order_bytes[64] = {
        0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
        4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
        8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
        12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
    const __m512i c = _mm512_permutexvar_epi8(_mm512_loadu_si512(order_bytes), _mm512_loadu_si512(codes));
    const __mmask64 high = _mm512_movepi8_mask(c);
    __m512i b[4];
    for (int k = 0; k < 4; k++) {
        __m512i lo = _mm512_permutex2var_epi8(t->plane[k][0], c, t->plane[k][1]);
        __m512i hi = _mm512_permutex2var_epi8(t->plane[k][2], c, t->plane[k][3]);
        b[k] = _mm512_mask_blend_epi8(high, lo, hi);
    }
    __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
    __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
}
#define DECODE64 1
#else
#define DECODE64 0
#endif

/* qmap[codes[0..15]] as 16 fp32 lanes. */
static inline __m512 gather_codebook(const uint8_t *codes, const float *qmap) {
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes)), qmap, 4);
}

/* qmap[code] for the 32 4-bit codes of packed[0..15], as two vectors of 16 fp32 in element order: a
 * 16-entry codebook fits one register (q16), so vpermps looks the codes up without a gather. Low and high
 * nibbles are split into two vectors of bytes 0..15, then interleaved back into element order. */
static inline void decode32_nibbles(const uint8_t *packed, __m512 q16, __m512 out[2]) {
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)packed));
    __m512i lo = _mm512_and_si512(bytes, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(bytes, 4);
    out[0] = _mm512_permutexvar_ps(_mm512_permutex2var_epi32(lo, first, hi), q16);
    out[1] = _mm512_permutexvar_ps(_mm512_permutex2var_epi32(lo, second, hi), q16);
}
#endif

/* Code i of a block's bit stream. */
static inline int code_at(const uint8_t *codes, int i, int bits) {
    if (bits == 8) return codes[i];
    int bit = i * bits, k = bit >> 3, sh = bit & 7;
    int v = codes[k] >> sh;
    if (sh + bits > 8) v |= codes[k + 1] << (8 - sh);
    return v & ((1 << bits) - 1);
}


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

/* buf[0 .. len) back into dst[off ..] as a 16-bit float dtype (BF16 / F16), rounding to nearest even. */
static void store_block(void *dst, int64_t off, int len, int dtype, const float *buf) {
    uint16_t *d = (uint16_t *)dst + off;
    if (dtype == BF16)
        for (int i = 0; i < len; i++) d[i] = f32_to_bf16(buf[i]);
    else
        for (int i = 0; i < len; i++) d[i] = f32_to_f16(buf[i]);
}

/* Quantize blocks [b0, b1) of src (dtype F32/BF16/F16; rows of row_len) into codes and absmax, the
 * whole tensor's (the row layout addresses each block). table: the code table (int32 [65536]). */
int ckq_quantize(const void *src, int dtype, int64_t row_len, int64_t block, int64_t b0, int64_t b1,
                  int sqrt_transform, const int32_t *table, uint8_t *codes, float *absmax, int bits,
                  const float *thr15) {
    if (BAD_BLOCK(block) || BAD_BITS(bits, block) || row_len < 1) return -1;
    const int32_t *middle = table + 32768;
    float buf[block];  /* C99 VLA: a block's values, at most 16 KB */
    rows_t at = rows_at(row_len, block, b0);
    for (int64_t b = b0; b < b1; b++, rows_next(&at)) {
        int len = rows_len(&at);
        uint8_t *c = codes + rows_code_byte(&at, bits);
        load_block(src, rows_offset(&at), len, dtype, sqrt_transform, buf);
        absmax[b] = block_absmax(buf, len);
        if (bits == 8)
            encode_nearest8(buf, len, absmax[b], middle, c);
        else
            encode_block(buf, len, absmax[b], middle, c, bits, 0, 0, 0, thr15);
    }
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
#if DECODE64
    planes_t planes;
    planes_init(&planes, qmap);
#endif
    rows_t at = rows_at(row_len, block, b0);
    for (int64_t b = b0; b < b1; b++, rows_next(&at)) {
        int len = rows_len(&at);
        float a = absmax[b];
        const uint8_t *c = codes + rows_code_byte(&at, bits);
        float *o = out + rows_offset(&at);
        int i = 0;
#if VEC
        const __m512 va = _mm512_set1_ps(a);
        if (bits == 4) {
            const __m512 q16 = _mm512_loadu_ps(qmap);
            for (; i + 32 <= len; i += 32) {
                __m512 q[2];
                decode32_nibbles(c + i / 2, q16, q);
                for (int r = 0; r < 2; r++) {
                    __m512 v = _mm512_mul_ps(q[r], va);
                    _mm512_storeu_ps(o + i + 16 * r, sqrt_transform ? _mm512_mul_ps(v, v) : v);
                }
            }
        }
#if DECODE64
        for (; bits == 8 && i + 64 <= len; i += 64) {
            __m512 q[4];
            decode64(&planes, c + i, q);
            for (int r = 0; r < 4; r++) {
                __m512 v = _mm512_mul_ps(q[r], va);
                _mm512_storeu_ps(o + i + 16 * r, sqrt_transform ? _mm512_mul_ps(v, v) : v);
            }
        }
#endif
        {  /* 16 at a time: what is left of 8 and 4 bits, and all of 6 and 2 */
            const unpack_t u = unpack_init(bits);
            const cb_t cb = cb_init(qmap, bits);
            for (; i + VEC <= len; i += VEC) {
                __m512 v = _mm512_mul_ps(cb_lookup(&cb, codes16(&u, c, i, bits), bits), va);
                _mm512_storeu_ps(o + i, sqrt_transform ? _mm512_mul_ps(v, v) : v);
            }
        }
#endif
        for (; i < len; i++) {
            float v = qmap[code_at(c, i, bits)] * a;
            o[i] = sqrt_transform ? v * v : v;
        }
    }
    return 0;
}

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
