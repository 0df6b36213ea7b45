/* ckptq CPU kernels: blockwise 8-, 6-, 4- and 2-bit quantize / dequantize and the fused low-bit Adam step.
 *
 * Plain C99 with no Python or torch headers, compiled on first use by ckptq/kernels/native.py
 * (`cc -O3 -march=native -ffp-contract=off -fno-math-errno`) and called through ctypes, which releases
 * the GIL: the Python side splits a tensor into chunks of whole blocks and runs them on a thread pool.
 * Where the CPU has AVX-512 (and VBMI) the hot loops use intrinsics; scalar C does the rest and runs
 * everywhere else.
 *
 * Every function here equals a PyTorch reference bit for bit (tests/test_native.py):
 *   ckq_quantize    <-> ckptq.kernels.backend_torch.quantize (reference_codes after the transform)
 *   ckq_dequantize  <-> ckptq.kernels.backend_torch.dequantize
 *   ckq_adam_step   <-> ckptq.kernels.backend_torch.adam_step (step_rows)
 * That is why no FMA contraction is allowed (-ffp-contract=off, and no fma intrinsics): each product and
 * sum is rounded to fp32 on its own, in the order the reference writes it. Division and sqrt are IEEE
 * (correctly rounded), scalar and vector alike.
 *
 * Rounding contract (ckptq.kernels.lut): code = #{j : t[j] < y} with t the 255 codebook midpoints and
 * y = x / absmax (IEEE division; an all-zero block divides by 1). The code table makes that one lookup:
 * the 2^16 buckets are the floats sharing their top 16 bits, indexed by (bits >> 16) + 2^15; entry
 * e = base << 17 | limit where base = #{t < every y of the bucket} and limit is the rank (the position
 * in increasing value order, 0..65535, inside the bucket) of the first y above the one threshold that may
 * lie inside the bucket (65536: none). Then code = base + (rank(y) >= limit); a NaN y gets 255, as
 * torch.searchsorted gives it. ckptq.kernels.lut.native_code_table builds the table from the thresholds.
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

#if VEC
/* acc = unsigned max(acc, bits of |x[0..15]|): block_absmax, 16 lanes at a time. */
static inline __m512i max_abs_bits(__m512i acc, const float *x) {
    __m512i a = _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x)), _mm512_set1_epi32(0x7FFFFFFF));
    return _mm512_max_epu32(acc, a);
}
#endif

/* The code table's answer for one y (see the header): #{t < y}, a NaN gets nan_code. */
static inline int nearest1(float y, const int32_t *table, int nan_code) {
    int32_t ybits = (int32_t)f2u(y);
    int32_t e = table[(ybits >> 16) + 32768];
    int32_t rank = (ybits ^ (ybits >> 31)) & 0xFFFF;  /* negative floats: larger bits, smaller value */
    int32_t code = (e >> 17) + (rank >= (e & 0x1FFFF));
    return y != y ? nan_code : code;
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
static inline __m512i nearest16(__m512 y, const int32_t *table, int nan_code) {
    const __m512i bias = _mm512_set1_epi32(32768), low16 = _mm512_set1_epi32(0xFFFF);
    const __m512i low17 = _mm512_set1_epi32(0x1FFFF), one = _mm512_set1_epi32(1);
    __m512i ybits = _mm512_castps_si512(y);
    __m512i e = _mm512_i32gather_epi32(_mm512_add_epi32(_mm512_srai_epi32(ybits, 16), bias), table, 4);
    __m512i rank = _mm512_and_si512(_mm512_xor_si512(ybits, _mm512_srai_epi32(ybits, 31)), low16);
    __m512i code = _mm512_srai_epi32(e, 17);
    code = _mm512_mask_add_epi32(code, _mm512_cmpge_epi32_mask(rank, _mm512_and_si512(e, low17)), code, one);
    return _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(nan_code));
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

/* How to unpack 16 codes of one width: each lane's first byte k, k + 1, its shift, the code mask. */
typedef struct { __m512i k, k1, sh, mask; int bits; } unpack_t;

static inline unpack_t unpack_init(int bits) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i bit = _mm512_mullo_epi32(iota, _mm512_set1_epi32(bits));
    __m512i k = _mm512_srli_epi32(bit, 3);
    unpack_t u = {k, _mm512_add_epi32(k, _mm512_set1_epi32(1)), _mm512_and_si512(bit, _mm512_set1_epi32(7)),
                  _mm512_set1_epi32((1 << bits) - 1), bits};
    return u;
}

/* The codes of elements i .. i + 15 (i a multiple of 16) as int32 lanes; reads only their 2 * bits bytes. */
static inline __m512i codes16(const unpack_t *u, const uint8_t *codes, int i) {
    const uint8_t *p = codes + i * u->bits / 8;
    if (u->bits == 8) return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    __m128i raw = _mm_maskz_loadu_epi8((__mmask16)((1u << (2 * u->bits)) - 1), p);
#else
    uint8_t tmp[16] = {0};
    memcpy(tmp, p, 2 * u->bits);
    __m128i raw = _mm_loadu_si128((const __m128i *)tmp);
#endif
    __m512i bytes = _mm512_cvtepu8_epi32(raw);
    __m512i word = _mm512_or_si512(_mm512_permutexvar_epi32(u->k, bytes),
                                   _mm512_slli_epi32(_mm512_permutexvar_epi32(u->k1, bytes), 8));
    return _mm512_and_si512(_mm512_srlv_epi32(word, u->sh), u->mask);
}

/* A codebook for 16-lane lookups: up to 16 entries in r[0], 64 in r[0..3], 256 read from q. */
typedef struct { __m512 r[4]; const float *q; int bits; } cb_t;

static inline cb_t cb_init(const float *q, int bits) {
    cb_t cb = {{_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()}, q, bits};
    if (q && bits <= 4) cb.r[0] = _mm512_maskz_loadu_ps((__mmask16)((1u << (1 << bits)) - 1), q);
    if (q && bits == 6)
        for (int j = 0; j < 4; j++) cb.r[j] = _mm512_loadu_ps(q + 16 * j);
    return cb;
}

static inline __m512 cb_lookup(const cb_t *cb, __m512i idx) {
    if (cb->bits <= 4) return _mm512_permutexvar_ps(idx, cb->r[0]);
    if (cb->bits == 6) {
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
static inline __m512i stochastic16_up(__m512 y, __m512i lo, const cb_t *q, __m512 u) {
    const int top = (1 << q->bits) - 1;
    const __m512i one = _mm512_set1_epi32(1), vtop = _mm512_set1_epi32(top);
    __mmask16 at_top = _mm512_cmpge_epi32_mask(lo, vtop);
    __m512 q_lo = cb_lookup(q, lo);
    __m512 q_hi = cb_lookup(q, _mm512_min_epi32(_mm512_add_epi32(lo, one), vtop));
    __mmask16 up = _mm512_cmp_ps_mask(_mm512_mul_ps(u, _mm512_sub_ps(q_hi, q_lo)), _mm512_sub_ps(y, q_lo), _CMP_LT_OQ);
    return _mm512_mask_mov_epi32(_mm512_mask_add_epi32(lo, up, lo, one), at_top, vtop);
}

/* stochastic1 on 16 lanes, from the nearest code c. */
static inline __m512i stochastic16(__m512 y, __m512i c, const cb_t *q, __m512 u) {
    const __m512i one = _mm512_set1_epi32(1);
    __m512i lo = _mm512_mask_sub_epi32(c, _mm512_cmp_ps_mask(y, cb_lookup(q, c), _CMP_LT_OQ), c, one);
    return stochastic16_up(y, _mm512_max_epi32(lo, _mm512_setzero_si512()), q, u);
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

/* code i = #{t < x[i] / safe} via the code table (see the header), or for 4 and 2 bits with the
 * thresholds thr15 in a register; a NaN gets the top code; codes packed as put_code does. With a codebook
 * q (stochastic rounding, ckptq.kernels.contract), the code is then rounded stochastically instead, with
 * the uniforms of hashes h (their high halves when ``high``). */
static inline void encode_block(const float *x, int len, float absmax, const int32_t *table, uint8_t *codes,
                                int bits, const float *q, const uint32_t *h, int high, const float *thr15) {
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
            code = stochastic16_up(y, count16_reg(y, cb.r[0], top, 1, 0), &cb, uniform16(h + i, high));
        else {
            code = in_register ? count16_reg(y, t15, top, 0, 1) : nearest16(y, table, top);
            if (q) code = stochastic16(y, code, &cb, uniform16(h + i, high));
        }
        put_codes16(codes, i, code, bits);
    }
#endif
    for (; i < len; i++) {  /* the vector loop stops at a multiple of 16: on a byte */
        float y = x[i] / safe;
        int code = nearest1(y, table, top);
        put_code(codes, i, q ? stochastic1(y, code, q, top, uniform1(h[i], high)) : code, bits);
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

/* Quantize elements [0, n) of src (dtype F32/BF16/F16) into codes [n * bits / 8, rounded up] and absmax
 * [ceil(n / block)]. */
int ckq_quantize(const void *src, int dtype, int64_t n, int64_t block, int sqrt_transform,
                  const int32_t *table, uint8_t *codes, float *absmax, int bits, const float *thr15) {
    if (BAD_BLOCK(block) || BAD_BITS(bits, block)) return -1;
    float buf[block];  /* C99 VLA: a block's values, at most 16 KB */
    for (int64_t b = 0, off = 0; off < n; b++, off += block) {
        int len = (int)(n - off < block ? n - off : block);
        load_block(src, off, len, dtype, sqrt_transform, buf);
        absmax[b] = block_absmax(buf, len);
        encode_block(buf, len, absmax[b], table, codes + off * bits / 8, bits, 0, 0, 0, thr15);
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

/* out[i] = qmap[code i] * absmax[i / block], then squared for the sqrt transform; fresh_out: out is
 * newly mapped memory, prefault it. qmap: 256 entries (a 4-bit codebook padded). */
int ckq_dequantize(const uint8_t *codes, const float *absmax, const float *qmap, int64_t n, int64_t block,
                    int sqrt_transform, float *out, int fresh_out, int bits) {
    if (BAD_BLOCK(block) || BAD_BITS(bits, block)) return -1;
    if (fresh_out) prefault(out, n * 4);
#if DECODE64
    planes_t planes;
    planes_init(&planes, qmap);
#endif
    for (int64_t b = 0, off = 0; off < n; b++, off += block) {
        int len = (int)(n - off < block ? n - off : block);
        float a = absmax[b];
        const uint8_t *c = codes + off * bits / 8;
        float *o = out + off;
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
        for (; bits == 8 && i + VEC <= len; i += VEC) {
            __m512 v = _mm512_mul_ps(gather_codebook(c + i, qmap), va);
            _mm512_storeu_ps(o + i, sqrt_transform ? _mm512_mul_ps(v, v) : v);
        }
        if (bits == 6 || bits == 2) {
            const unpack_t u = unpack_init(bits);
            const cb_t cb = cb_init(qmap, bits);
            for (; i + VEC <= len; i += VEC) {
                __m512 v = _mm512_mul_ps(cb_lookup(&cb, codes16(&u, c, i)), va);
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

/* Hyperparameters, fp32 [10], in ckptq.kernels.contract.HYPER_FIELDS order. */
enum { DECAY, L2, OMB1, BETA2, OMB2, EPS, NEG_STEP, BC2_SQRT, DECODE_EPS, ENCODE_EPS };

#if VEC
/* The new values' block maxima as they are made (block_absmax's unsigned max on the bits, in acc[0..2]
 * for the ratio, sqrt(v), sqrt(vmax)): small blocks then skip a pass each. */
static inline void track16(__m512i acc[3], const float *mb, const float *sb, const float *xb, int amsgrad) {
    acc[0] = max_abs_bits(acc[0], mb);
    acc[1] = max_abs_bits(acc[1], sb);
    if (amsgrad) acc[2] = max_abs_bits(acc[2], xb);
}

/* The block maxima that track16 gathered; returns 1 (they are known). */
static inline int take_maxima(const __m512i acc[3], float *mx, float *sx, float *xx) {
    *mx = bits_to_absmax(_mm512_reduce_max_epu32(acc[0]));
    *sx = bits_to_absmax(_mm512_reduce_max_epu32(acc[1]));
    *xx = bits_to_absmax(_mm512_reduce_max_epu32(acc[2]));
    return 1;
}

/* Scalars of the step broadcast to 16 lanes, and its switches. */
typedef struct {
    __m512 dec_eps, l2, omb1, beta2, omb2, bc2_sqrt, eps, decay, neg_step, enc_eps;
    int ratio, maximize, amsgrad;
} vstep_t;

/* The step on 16 elements: s = sqrt(v), m (as decoded: a ratio when k->ratio) and, with amsgrad, xs =
 * sqrt(max_exp_avg_sq), all already times their block's absmax. Writes the new param to pf, and the new
 * ratio, sqrt(v) and sqrt(vmax) to mb, sb, xb for requantization; the scalar loop below, vectorized. */
static inline void step16(const vstep_t *k, __m512 s, __m512 m, __m512 xs, const float *gf, float *pf,
                          float *mb, float *sb, float *xb) {
    if (k->ratio) m = _mm512_mul_ps(m, _mm512_add_ps(s, k->dec_eps));
    __m512 gi = _mm512_loadu_ps(gf), pi = _mm512_loadu_ps(pf);
    if (k->maximize) gi = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gi), _mm512_set1_epi32(INT32_MIN)));
    gi = _mm512_add_ps(gi, _mm512_mul_ps(k->l2, pi));
    m = _mm512_add_ps(m, _mm512_mul_ps(k->omb1, _mm512_sub_ps(gi, m)));
    __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(s, s), k->beta2), _mm512_mul_ps(k->omb2, _mm512_mul_ps(gi, gi)));
    __m512 snew = _mm512_sqrt_ps(v), root = snew;
    if (k->amsgrad) {
        __m512 vmax = _mm512_mul_ps(xs, xs);
        __mmask16 nan = _mm512_cmp_ps_mask(vmax, v, _CMP_UNORD_Q);
        vmax = _mm512_mask_mov_ps(_mm512_max_ps(vmax, v), nan, _mm512_set1_ps(NAN));  /* torch.maximum */
        root = _mm512_sqrt_ps(vmax);
        _mm512_storeu_ps(xb, root);
    }
    __m512 denom = _mm512_add_ps(_mm512_div_ps(root, k->bc2_sqrt), k->eps);
    _mm512_storeu_ps(pf, _mm512_add_ps(_mm512_mul_ps(pi, k->decay), _mm512_mul_ps(k->neg_step, _mm512_div_ps(m, denom))));
    _mm512_storeu_ps(mb, _mm512_div_ps(m, _mm512_add_ps(snew, k->enc_eps)));
    _mm512_storeu_ps(sb, snew);
}
#endif

/* The fused step on elements [0, n) (whole blocks but the last): param p (dtype pdtype) in place,
 * grad g (gdtype), first moment m (a ratio state when m_ratio), second moment v (sqrt transform), and
 * with amsgrad (x.codes != NULL) max_exp_avg_sq x (sqrt transform), with codes of m_bits, v_bits and
 * x_bits bits (decode maps of 256 entries; m_thr, v_thr, x_thr: the thresholds of encode maps of up to
 * 16 entries, which the vector loops search in a register, the code tables serving the rest). Operation
 * order as step_rows.
 * With m_round / v_round (the first / second moment's encode codebook) its new codes are rounded
 * stochastically, both from one hash per element, mix32(i ^ seed) with i = ``first`` + the element's
 * index here (the first moment its high 16 bits, the second its low 16). */
int ckq_adam_step(void *p, int pdtype, const void *g, int gdtype, int64_t n, int64_t block,
                   uint8_t *m_codes, float *m_absmax, const float *m_decode, const int32_t *m_table, int m_ratio,
                   uint8_t *v_codes, float *v_absmax, const float *v_decode, const int32_t *v_table,
                   uint8_t *x_codes, float *x_absmax, const float *x_decode, const int32_t *x_table,
                   const float *h, int maximize, int m_bits, int v_bits, int x_bits, const float *m_round,
                   const float *v_round, int64_t first, uint32_t seed, const float *m_thr, const float *v_thr,
                   const float *x_thr) {
    if (BAD_BLOCK(block) || BAD_BITS(m_bits, block) || BAD_BITS(v_bits, block) || (x_codes && BAD_BITS(x_bits, block)))
        return -1;
    const int bits = m_bits == v_bits && (!x_codes || x_bits == m_bits) ? m_bits : 0;  /* 0: widths differ */
    /* one block each of param, grad (other dtypes than fp32), new ratio, sqrt(v), sqrt(vmax) and the
     * stochastic rounding hashes: C99 VLAs, 6 KB at the default block size, 96 KB at 4096 */
    float pb[block], gb[block], mb[block], sb[block], xb[block];
    uint32_t hb[block];
    const float decay = h[DECAY], l2 = h[L2], omb1 = h[OMB1], beta2 = h[BETA2], omb2 = h[OMB2], eps = h[EPS];
    const float neg_step = h[NEG_STEP], bc2_sqrt = h[BC2_SQRT], dec_eps = h[DECODE_EPS], enc_eps = h[ENCODE_EPS];
    const int amsgrad = x_codes != 0;
#if VEC
    const vstep_t k = {
        _mm512_set1_ps(dec_eps), _mm512_set1_ps(l2), _mm512_set1_ps(omb1), _mm512_set1_ps(beta2),
        _mm512_set1_ps(omb2), _mm512_set1_ps(bc2_sqrt), _mm512_set1_ps(eps), _mm512_set1_ps(decay),
        _mm512_set1_ps(neg_step), _mm512_set1_ps(enc_eps), m_ratio, maximize, amsgrad};
#endif
#if VEC  /* 4-bit codebooks, one register each (the first 16 entries of the decode maps) */
    const __m512 m16 = _mm512_loadu_ps(m_decode), v16 = _mm512_loadu_ps(v_decode);
    const __m512 x16 = amsgrad ? _mm512_loadu_ps(x_decode) : v16;
    /* the generic path (widths differ, or 6 / 2 bits): unpackers and codebooks per moment */
    const unpack_t mu = unpack_init(m_bits), vu = unpack_init(v_bits), xu = unpack_init(amsgrad ? x_bits : v_bits);
    const cb_t mcb = cb_init(m_decode, m_bits), vcb = cb_init(v_decode, v_bits);
    const cb_t xcb = cb_init(amsgrad ? x_decode : v_decode, amsgrad ? x_bits : v_bits);
#endif
#if DECODE64
    planes_t m_planes, v_planes, x_planes;
    planes_init(&m_planes, m_decode);
    planes_init(&v_planes, v_decode);
    if (amsgrad) planes_init(&x_planes, x_decode);
#endif
    for (int64_t b = 0, off = 0; off < n; b++, off += block) {
        int len = (int)(n - off < block ? n - off : block);
        /* fp32 param and grad are used in place; other dtypes go through fp32 buffers */
        float *pf = pdtype == F32 ? (float *)p + off : pb;
        const float *gf = gdtype == F32 ? (const float *)g + off : gb;
        if (pdtype != F32) load_block(p, off, len, pdtype, 0, pb);
        if (gdtype != F32) load_block(g, off, len, gdtype, 0, gb);
        const float ma = m_absmax[b], va = v_absmax[b], xa = amsgrad ? x_absmax[b] : 0.0f;
        /* the block's first code byte in each stream */
        const int64_t m_at = off * m_bits / 8, v_at = off * v_bits / 8, x_at = off * x_bits / 8;
        const uint8_t *mc = m_codes + m_at, *vc = v_codes + v_at, *xc = amsgrad ? x_codes + x_at : 0;
        int i = 0, have_max = 0;  /* have_max: mx, sx, xx hold the block maxima of mb, sb, xb */
        float mx = 0.0f, sx = 0.0f, xx = 0.0f;
#if VEC
        const __m512 vma = _mm512_set1_ps(ma), vva = _mm512_set1_ps(va), vxa = _mm512_set1_ps(xa);
        if (bits == 4) {
            /* the block maxima as they are made (track16): that makes block 128 as fast as 8 bits' 256 */
            __m512i acc[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
            for (; i + 32 <= len; i += 32) {
                __m512 sq[2], mq[2], xq[2] = {vxa, vxa};
                decode32_nibbles(vc + i / 2, v16, sq);
                decode32_nibbles(mc + i / 2, m16, mq);
                if (amsgrad) decode32_nibbles(xc + i / 2, x16, xq);
                for (int r = 0; r < 2; r++) {
                    int j = i + 16 * r;
                    step16(&k, _mm512_mul_ps(sq[r], vva), _mm512_mul_ps(mq[r], vma),
                           amsgrad ? _mm512_mul_ps(xq[r], vxa) : vxa, gf + j, pf + j, mb + j, sb + j, xb + j);
                    track16(acc, mb + j, sb + j, xb + j, amsgrad);
                }
            }
            if (i == len) have_max = take_maxima(acc, &mx, &sx, &xx);
        }
        if (bits != 8 && bits != 4) {  /* widths differ (the 4-bit budget's 6 + 2), or all 6 / all 2 */
            __m512i acc[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
            for (; i + VEC <= len; i += VEC) {
                __m512 s = _mm512_mul_ps(cb_lookup(&vcb, codes16(&vu, vc, i)), vva);
                __m512 m = _mm512_mul_ps(cb_lookup(&mcb, codes16(&mu, mc, i)), vma);
                __m512 xs = amsgrad ? _mm512_mul_ps(cb_lookup(&xcb, codes16(&xu, xc, i)), vxa) : vxa;
                step16(&k, s, m, xs, gf + i, pf + i, mb + i, sb + i, xb + i);
                track16(acc, mb + i, sb + i, xb + i, amsgrad);
            }
            if (i == len) have_max = take_maxima(acc, &mx, &sx, &xx);
        }
#if DECODE64
        for (; bits == 8 && i + 64 <= len; i += 64) {
            __m512 sq[4], mq[4], xq[4];
            decode64(&v_planes, vc + i, sq);
            decode64(&m_planes, mc + i, mq);
            if (amsgrad) decode64(&x_planes, xc + i, xq);
            for (int r = 0; r < 4; r++) {
                int j = i + 16 * r;
                step16(&k, _mm512_mul_ps(sq[r], vva), _mm512_mul_ps(mq[r], vma),
                       amsgrad ? _mm512_mul_ps(xq[r], vxa) : vxa, gf + j, pf + j, mb + j, sb + j, xb + j);
            }
        }
#endif
        for (; bits == 8 && i + VEC <= len; i += VEC) {
            __m512 s = _mm512_mul_ps(gather_codebook(vc + i, v_decode), vva);
            __m512 m = _mm512_mul_ps(gather_codebook(mc + i, m_decode), vma);
            __m512 xs = amsgrad ? _mm512_mul_ps(gather_codebook(xc + i, x_decode), vxa) : vxa;
            step16(&k, s, m, xs, gf + i, pf + i, mb + i, sb + i, xb + i);
        }
#endif
        for (; i < len; i++) {
            float s = v_decode[code_at(vc, i, v_bits)] * va;  /* sqrt(v) as stored */
            float m = m_decode[code_at(mc, i, m_bits)] * ma;
            if (m_ratio) m = m * (s + dec_eps);
            float gi = maximize ? -gf[i] : gf[i];
            float pi = pf[i];
            gi = gi + l2 * pi;
            m = m + omb1 * (gi - m);
            float v = (s * s) * beta2 + omb2 * (gi * gi);
            float snew = sqrtf(v);
            float denom_root = snew;
            if (amsgrad) {
                float xs = x_decode[code_at(xc, i, x_bits)] * xa;
                float vmax = xs * xs;
                vmax = (vmax != vmax || v != v) ? NAN : (vmax > v ? vmax : v);  /* torch.maximum */
                denom_root = sqrtf(vmax);
                xb[i] = denom_root;
            }
            float denom = denom_root / bc2_sqrt + eps;
            pf[i] = pi * decay + neg_step * (m / denom);
            mb[i] = m / (snew + enc_eps);  /* the ratio to the new exact second moment */
            sb[i] = snew;
        }
        if (pdtype == BF16) {
            uint16_t *d = (uint16_t *)p + off;
            for (int i = 0; i < len; i++) d[i] = f32_to_bf16(pb[i]);
        } else if (pdtype == F16) {
            uint16_t *d = (uint16_t *)p + off;
            for (int i = 0; i < len; i++) d[i] = f32_to_f16(pb[i]);
        }
        m_absmax[b] = have_max ? mx : block_absmax(mb, len);
        if (m_round || v_round) hashes(hb, len, first + off, seed);
        encode_block(mb, len, m_absmax[b], m_table, m_codes + m_at, m_bits, m_round, hb, 1, m_thr);
        v_absmax[b] = have_max ? sx : block_absmax(sb, len);
        encode_block(sb, len, v_absmax[b], v_table, v_codes + v_at, v_bits, v_round, hb, 0, v_thr);
        if (amsgrad) {
            x_absmax[b] = have_max ? xx : block_absmax(xb, len);
            encode_block(xb, len, x_absmax[b], x_table, x_codes + x_at, x_bits, 0, 0, 0, x_thr);
        }
    }
    return 0;
}
