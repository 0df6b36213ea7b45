/* ckptq's SIMD layer on AVX-512 (see simd.h): 16 fp32 lanes, lane masks in k registers.
 *
 * The 16-lane helpers below were cpu_kernels.c's AVX-512 code, moved here unchanged: the layer's operations
 * at the end of this file are these same functions under the layer's names, so that the blocks simd.h
 * writes once compile here to the instructions the AVX-512 kernels ran before.
 */
#ifndef CKQ_SIMD_AVX512_H
#define CKQ_SIMD_AVX512_H
#include <immintrin.h>


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
 * strict) the entry at or below y that stochastic rounding starts from (simd.h's v_stochastic_up). */
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

/* ---- The layer's operations (simd.h lists them) ---- */
#define VL 16
#define SIMD_ISA "avx512"
/* Codes of 4 and 2 bits by a binary search of the thresholds held in one register (count16_reg), not a
 * gather from the code table. */
#define SIMD_SEARCH 1

typedef __m512 vf;
typedef __m512i vi;
typedef __mmask16 vm;

static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf v_load_n(const float *p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
static inline void v_store_n(float *p, vf x, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), x); }
static inline vf v_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* vcvtph2ps: exact, as f16_to_f32 (a signalling NaN comes out quiet; NaN payloads are not in the contract). */
static inline vf v_load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf v_set1(float x) { return _mm512_set1_ps(x); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf v_sqrt(vf a) { return _mm512_sqrt_ps(a); }
static inline vm v_lt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
static inline vm v_le(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
static inline vm v_isnan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
static inline vf v_select(vm m, vf t, vf f) { return _mm512_mask_mov_ps(f, m, t); }
static inline vi v_as_bits(vf x) { return _mm512_castps_si512(x); }
static inline vf v_from_bits(vi x) { return _mm512_castsi512_ps(x); }
static inline vf v_from_int(vi x) { return _mm512_cvtepi32_ps(x); }

static inline vi vi_set1(int32_t x) { return _mm512_set1_epi32(x); }
static inline vi vi_iota(void) { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline vi vi_load(const uint32_t *p) { return _mm512_loadu_si512(p); }
static inline void vi_store(uint32_t *p, vi x) { _mm512_storeu_si512(p, x); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vi_xor(vi a, vi b) { return _mm512_xor_si512(a, b); }
static inline vi vi_mullo(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
#define vi_srl(x, n) _mm512_srli_epi32((x), (n))
#define vi_sll(x, n) _mm512_slli_epi32((x), (n))
#define vi_sra(x, n) _mm512_srai_epi32((x), (n))
static inline vi vi_min(vi a, vi b) { return _mm512_min_epi32(a, b); }
static inline vi vi_max(vi a, vi b) { return _mm512_max_epi32(a, b); }
static inline vi vi_max_u(vi a, vi b) { return _mm512_max_epu32(a, b); }
static inline vm vi_ge(vi a, vi b) { return _mm512_cmpge_epi32_mask(a, b); }
static inline vi vi_select(vm m, vi t, vi f) { return _mm512_mask_mov_epi32(f, m, t); }
static inline vi vi_add_if(vi a, vm m, vi b) { return _mm512_mask_add_epi32(a, m, a, b); }
static inline vi vi_sub_if(vi a, vm m, vi b) { return _mm512_mask_sub_epi32(a, m, a, b); }
static inline uint32_t vi_reduce_max_u(vi x) { return (uint32_t)_mm512_reduce_max_epu32(x); }

/* f32 -> bf16 and f16, as f32_to_bf16 and f32_to_f16 (vcvtps2ph rounds to nearest even, gives inf from
 * 65520 up and keeps a NaN's top payload bits with the quiet bit set, as f32_to_f16 does). */
static inline void v_store_bf16(uint16_t *p, vf x) {
    vi u = _mm512_castps_si512(x);
    vi r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                              _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    r = _mm512_mask_mov_epi32(r, v_isnan(x), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
static inline void v_store_f16(uint16_t *p, vf x) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

typedef unpack_t vunpack_t;
static inline vunpack_t v_unpack_init(int bits) { return unpack_init(bits); }
static inline vi v_unpack(const vunpack_t *u, const uint8_t *codes, int i, int bits) {
    return codes16(u, codes, i, bits);
}
static inline void v_pack(uint8_t *codes, int i, vi code, int bits) { put_codes16(codes, i, code, bits); }

static inline vi v_nearest(vf y, const int32_t *table) { return nearest16(y, table); }

/* A sorted run held in one register: r[first + k] is the run's entry k. */
typedef struct { __m512 r; int first; } vsearch_t;
typedef cb_t vcb_t;
static inline vsearch_t v_search_init(const float *r, int top) {
    vsearch_t s = {r ? _mm512_maskz_loadu_ps((__mmask16)((1u << top) - 1), r) : _mm512_setzero_ps(), 0};
    return s;
}
/* The codebook's entries 1 .. top: its lookup register already holds them, one lane up. */
static inline vsearch_t v_search_book(const vcb_t *cb, const float *q, int top) {
    vsearch_t s = {cb->r[0], 1};
    (void)q, (void)top;
    return s;
}
static inline vi v_count(vf y, const vsearch_t *s, int top, int strict) {
    return count16_reg(y, s->r, top, s->first, strict);
}
static inline __attribute__((always_inline)) vcb_t vcb_init(const float *q, int bits) { return cb_init(q, bits); }
static inline vf vcb_lookup(const vcb_t *cb, vi idx, int bits) { return cb_lookup(cb, idx, bits); }

static inline vi v_mix32(vi x) { return mix32x16(x); }

#define SIMD_DECODE_WIDE 1
/* Decoding's wide loops (simd.h's decode_block runs them first, then the 16-lane loop): 32 4-bit codes at a
 * time through decode32_nibbles, and with VBMI 64 8-bit ones through decode64 (its byte planes: the
 * extra state of a prepared decode codebook). */
#if DECODE64
typedef struct { planes_t planes; } simd_decode_extra_t;
#else
typedef struct { int unused; } simd_decode_extra_t;
#endif

static inline void simd_decode_extra_init(simd_decode_extra_t *x, const float *q, int bits) {
#if DECODE64
    if (bits == 8) planes_init(&x->planes, q);
#else
    (void)x, (void)q, (void)bits;
#endif
}

/* Elements [0, i) of a block decoded (qmap[code] * va, squared when ``square``) into o: returns i. */
static inline __attribute__((always_inline)) int simd_decode_wide(const simd_decode_extra_t *x, const vcb_t *cb,
                                                                  const uint8_t *c, int len, int bits, vf va,
                                                                  int square, float *o) {
    int i = 0;
    (void)x;
    if (bits == 4)
        for (; i + 32 <= len; i += 32) {
            __m512 q[2];
            decode32_nibbles(c + i / 2, cb->r[0], q);
            for (int r = 0; r < 2; r++) {
                __m512 v = _mm512_mul_ps(q[r], va);
                _mm512_storeu_ps(o + i + 16 * r, square ? _mm512_mul_ps(v, v) : v);
            }
        }
#if DECODE64
    for (; bits == 8 && i + 64 <= len; i += 64) {
        __m512 q[4];
        decode64(&x->planes, c + i, q);
        for (int r = 0; r < 4; r++) {
            __m512 v = _mm512_mul_ps(q[r], va);
            _mm512_storeu_ps(o + i + 16 * r, square ? _mm512_mul_ps(v, v) : v);
        }
    }
#endif
    return i;
}

#endif /* CKQ_SIMD_AVX512_H */
