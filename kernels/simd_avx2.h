/* ckptq's SIMD layer on AVX2 (see simd.h): 8 fp32 lanes, lane masks as all-ones lanes of a vector.
 *
 * What AVX2 lacks beside AVX-512, and what stands in for it here:
 * - no 16-lane permute: a 16-entry codebook or threshold run is two registers; a lookup permutes both
 *   (vpermps takes the low 3 bits of the index) and blends on bit 3. The binary search of 15 sorted
 *   thresholds compares the middle one first (a broadcast), which gives each lane its half, then
 *   probes that half 3 times, each a permute of both registers and a blend;
 * - no mask registers: compares give all-ones lanes, selects are blends, "add where" is an and + add;
 * - no byte-granular compress: 8 codes of ``bits`` bits are ``bits`` bytes, unpacked by broadcasting
 *   them as one 64-bit word, moving each code's two bytes into its lane (vpshufb: both 128-bit halves
 *   hold the word) and a variable shift; packed by shifting each code to its place in its group of 4
 *   (one group: bits / 2 bytes), or-ing the groups' lanes together and storing the two words;
 * - fp16: F16C's vcvtph2ps / vcvtps2ph (every AVX2 CPU has it; x86-64-v3 includes it), per lane without;
 * - the 256 KB code table and 64- and 256-entry codebooks are read one lane at a time (lookup8_epi32 says
 *   why not with a gather); 8-bit codes decode straight from their bytes (simd_decode8).
 */
#ifndef CKQ_SIMD_AVX2_H
#define CKQ_SIMD_AVX2_H
#include <immintrin.h>

#define VL 8
#define SIMD_ISA "avx2"
#define SIMD_SEARCH 1  /* codes of 4 and 2 bits by a search of the thresholds in registers */

typedef __m256 vf;
typedef __m256i vi;
typedef __m256i vm;  /* all-ones lanes where true */

static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vi vi_iota(void) { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
/* lanes below n (vmaskmovps: the others are neither read nor written, so no fault past an array's end) */
static inline vi lanes_below(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), vi_iota()); }
static inline vf v_load_n(const float *p, int n) { return _mm256_maskload_ps(p, lanes_below(n)); }
static inline void v_store_n(float *p, vf x, int n) { _mm256_maskstore_ps(p, lanes_below(n), x); }
static inline vf v_set1(float x) { return _mm256_set1_ps(x); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf v_sqrt(vf a) { return _mm256_sqrt_ps(a); }
static inline vm v_lt(vf a, vf b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
static inline vm v_le(vf a, vf b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LE_OQ)); }
static inline vm v_isnan(vf a) { return _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
static inline vf v_select(vm m, vf t, vf f) { return _mm256_blendv_ps(f, t, _mm256_castsi256_ps(m)); }
static inline vi v_as_bits(vf x) { return _mm256_castps_si256(x); }
static inline vf v_from_bits(vi x) { return _mm256_castsi256_ps(x); }
static inline vf v_from_int(vi x) { return _mm256_cvtepi32_ps(x); }

static inline vi vi_set1(int32_t x) { return _mm256_set1_epi32(x); }
static inline vi vi_load(const uint32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void vi_store(uint32_t *p, vi x) { _mm256_storeu_si256((__m256i *)p, x); }
static inline vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
static inline vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
static inline vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi vi_xor(vi a, vi b) { return _mm256_xor_si256(a, b); }
static inline vi vi_mullo(vi a, vi b) { return _mm256_mullo_epi32(a, b); }
#define vi_srl(x, n) _mm256_srli_epi32((x), (n))
#define vi_sll(x, n) _mm256_slli_epi32((x), (n))
#define vi_sra(x, n) _mm256_srai_epi32((x), (n))
static inline vi vi_min(vi a, vi b) { return _mm256_min_epi32(a, b); }
static inline vi vi_max(vi a, vi b) { return _mm256_max_epi32(a, b); }
static inline vi vi_max_u(vi a, vi b) { return _mm256_max_epu32(a, b); }
static inline vm vi_ge(vi a, vi b) { return _mm256_or_si256(_mm256_cmpgt_epi32(a, b), _mm256_cmpeq_epi32(a, b)); }
static inline vi vi_select(vm m, vi t, vi f) { return _mm256_blendv_epi8(f, t, m); }
static inline vi vi_add_if(vi a, vm m, vi b) { return _mm256_add_epi32(a, _mm256_and_si256(m, b)); }
static inline vi vi_sub_if(vi a, vm m, vi b) { return _mm256_sub_epi32(a, _mm256_and_si256(m, b)); }
static inline uint32_t vi_reduce_max_u(vi x) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(m);
}

static inline vf v_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* f32 -> bf16 as f32_to_bf16: round to nearest even on the bits, NaN -> 0x7FC0; the 16-bit halves packed
 * (no saturation: each is <= 0xFFFF). */
static inline void v_store_bf16(uint16_t *p, vf x) {
    vi u = _mm256_castps_si256(x);
    vi r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                              _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
    r = vi_select(v_isnan(x), _mm256_set1_epi32(0x7FC0), r);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

#ifdef __F16C__
/* vcvtph2ps is exact, as f16_to_f32 (a signalling NaN comes out quiet: NaN payloads are not in the
 * contract); vcvtps2ph rounds to nearest even, gives inf from 65520 up and keeps a NaN's top payload
 * bits with the quiet bit set, as f32_to_f16. */
static inline vf v_load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void v_store_f16(uint16_t *p, vf x) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
static inline vf v_load_f16(const uint16_t *p) {
    float t[8];
    for (int k = 0; k < 8; k++) t[k] = f16_to_f32(p[k]);
    return _mm256_loadu_ps(t);
}
static inline void v_store_f16(uint16_t *p, vf x) {
    float t[8];
    _mm256_storeu_ps(t, x);
    for (int k = 0; k < 8; k++) p[k] = f32_to_f16(t[k]);
}
#endif

/* Unpacking 8 codes: per lane, the positions of its code's two bytes in the 64-bit word (vpshufb
 * control; 0x80: zero) and its shift inside them. */
typedef struct { __m256i ctl, sh, mask; } vunpack_t;

static inline vunpack_t v_unpack_init(int bits) {
    int32_t ctl[8], sh[8];
    for (int j = 0; j < 8; j++) {
        int bit = j * bits, k = bit >> 3;
        ctl[j] = (int32_t)(0x80800000u | (uint32_t)(k + 1) << 8 | (uint32_t)k);
        sh[j] = bit & 7;
    }
    vunpack_t u = {_mm256_loadu_si256((const __m256i *)ctl), _mm256_loadu_si256((const __m256i *)sh),
                   _mm256_set1_epi32((1 << bits) - 1)};
    return u;
}

/* The codes of elements i .. i + 7 (i a multiple of 8) as int32 lanes; reads only their ``bits`` bytes. */
static inline vi v_unpack(const vunpack_t *u, const uint8_t *codes, int i, int bits) {
    const uint8_t *p = codes + i * bits / 8;
    if (bits == 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    uint64_t w = 0;
    memcpy(&w, p, bits);
    __m256i two = _mm256_shuffle_epi8(_mm256_set1_epi64x((long long)w), u->ctl);
    return _mm256_and_si256(_mm256_srlv_epi32(two, u->sh), u->mask);
}

/* Codes of elements i .. i + 7 (i a multiple of 8) into the bit stream: exactly ``bits`` bytes. */
static inline void v_pack(uint8_t *codes, int i, vi code, int bits) {
    uint8_t *p = codes + i * bits / 8;
    if (bits == 8) {  /* byte 0 of each lane to the low dword of its 128-bit half, then the two dwords together */
        const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                   0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
        __m256i b = _mm256_shuffle_epi8(code, low_bytes);
        b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
        _mm_storel_epi64((__m128i *)p, _mm256_castsi256_si128(b));
        return;
    }
    if (bits == 4) {  /* each odd lane's code onto bits 4..7 of the even lane's, then those 4 bytes together */
        const __m256i pair_bytes = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                    -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
        __m256i b = _mm256_shuffle_epi8(_mm256_or_si256(code, _mm256_srli_epi64(code, 28)), pair_bytes);
        __m128i both = _mm_or_si128(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
        uint32_t four = (uint32_t)_mm_cvtsi128_si32(both);
        memcpy(p, &four, 4);
        return;
    }
    const int b = bits;  /* each group of 4 lanes -> c0 | c1 << b | c2 << 2b | c3 << 3b, in every lane of the group */
    __m256i w = _mm256_sllv_epi32(code, _mm256_setr_epi32(0, b, 2 * b, 3 * b, 0, b, 2 * b, 3 * b));
    w = _mm256_or_si256(w, _mm256_shuffle_epi32(w, 0xB1));  /* lanes (1, 0, 3, 2) */
    w = _mm256_or_si256(w, _mm256_shuffle_epi32(w, 0x4E));  /* lanes (2, 3, 0, 1) */
    uint64_t two = (uint32_t)_mm256_cvtsi256_si32(w) | (uint64_t)(uint32_t)_mm256_extract_epi32(w, 4) << (4 * b);
    memcpy(p, &two, b);
}

/* table[at[k]] for the 8 lanes of at, by 8 scalar loads. Not vpgatherdd: on Zen 1-3 a gather of 8 costs more
 * than 8 loads (Agner Fog's instruction tables list ~4-9 cycles per ymm gather; here the 8-bit quantize
 * took 2.25 cycles per element with gathers, 1.9 with loads, in L2), and on Intel Skylake to Tiger Lake
 * the microcode against Gather Data Sampling (Intel SA-00828, 2023) makes gathers several times slower. */
static inline __m256i lookup8_epi32(const int32_t *table, __m256i at) {
    int32_t k[8];
    _mm256_storeu_si256((__m256i *)k, at);
    return _mm256_setr_epi32(table[k[0]], table[k[1]], table[k[2]], table[k[3]], table[k[4]], table[k[5]], table[k[6]],
                             table[k[7]]);
}

/* Stochastic rounding on an 8-bit codebook reads q[c - 1], q[c] and q[c + 1] of each lane's nearest code c:
 * three lane-by-lane table reads (lookup8_epi32) cost more than the rest of the step's encode. Instead each
 * lane loads its code's row of a neighbour table (nb[4 c .. 4 c + 2] = q[c - 1], q[c], q[c + 1], clamped
 * at the ends; vencode_init builds it) with one 16-byte load, and a 4 x 8 transpose gives the three vectors. */
#define SIMD_NEIGHBOURS 1
static inline void simd_neighbours(const float *nb, vi c, vf *below, vf *at, vf *above) {
    int32_t k[8];
    _mm256_storeu_si256((__m256i *)k, c);
    __m256 a0 = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_load_ps(nb + 4 * k[0])), _mm_load_ps(nb + 4 * k[4]), 1);
    __m256 a1 = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_load_ps(nb + 4 * k[1])), _mm_load_ps(nb + 4 * k[5]), 1);
    __m256 a2 = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_load_ps(nb + 4 * k[2])), _mm_load_ps(nb + 4 * k[6]), 1);
    __m256 a3 = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_load_ps(nb + 4 * k[3])), _mm_load_ps(nb + 4 * k[7]), 1);
    __m256 t0 = _mm256_unpacklo_ps(a0, a1), t1 = _mm256_unpackhi_ps(a0, a1);  /* per half: rows 0, 1 interleaved */
    __m256 t2 = _mm256_unpacklo_ps(a2, a3), t3 = _mm256_unpackhi_ps(a2, a3);  /* rows 2, 3 */
    *below = _mm256_shuffle_ps(t0, t2, 0x44);  /* entry 0 of rows 0..3 (and 4..7 in the high half) */
    *at = _mm256_shuffle_ps(t0, t2, 0xEE);     /* entry 1 */
    *above = _mm256_shuffle_ps(t1, t3, 0x44);  /* entry 2 */
}

/* nearest1 on 8 lanes: 8 table reads, the rank (the low 16 bits, flipped for negative y) and an add. */
static inline vi v_nearest(vf y, const int32_t *table) {
    __m256i ybits = _mm256_castps_si256(y);
    __m256i e = lookup8_epi32(table, _mm256_srai_epi32(ybits, 16));
    __m256i rank = _mm256_and_si256(_mm256_xor_si256(ybits, _mm256_srai_epi32(ybits, 31)), _mm256_set1_epi32(0xFFFF));
    return _mm256_srli_epi32(_mm256_add_epi32(e, rank), 17);
}

/* A sorted run of up to 15 entries: lo holds entries 0..7, hi 8..14, mid entry 7 in every lane. */
typedef struct { __m256 lo, hi, mid; } vsearch_t;
/* A codebook of up to 16 entries in two registers (lo: 0..7, hi: 8..15), or a larger one read from q. */
typedef struct { __m256 lo, hi; const float *q; } vcb_t;

static inline vsearch_t v_search_init(const float *r, int top) {
    float t[16] = {0};
    if (r) memcpy(t, r, (size_t)top * sizeof(float));
    vsearch_t s = {_mm256_loadu_ps(t), _mm256_loadu_ps(t + 8), _mm256_set1_ps(t[7])};
    return s;
}

static inline vsearch_t v_search_book(const vcb_t *cb, const float *q, int top) {
    (void)cb;
    return v_search_init(q ? q + 1 : 0, top);
}

/* #{k < top : r[k] < y} (strict) or <= y, top = 2**bits - 1 <= 15, by binary search; a NaN y counts top.
 * With 15 entries the middle one (a broadcast) decides each lane's half first; the later probes read
 * both registers at the lane's index in its half and keep the one of its half. */
static inline vi v_count(vf y, const vsearch_t *s, int top, int strict) {
    __m256i pos = _mm256_setzero_si256(), local = _mm256_setzero_si256();
    __m256 upper = _mm256_setzero_ps();
    int step = (top + 1) / 2;
    if (top == 15) {
        upper = strict ? _mm256_cmp_ps(s->mid, y, _CMP_LT_OQ) : _mm256_cmp_ps(s->mid, y, _CMP_LE_OQ);
        pos = _mm256_and_si256(_mm256_castps_si256(upper), _mm256_set1_epi32(8));
        step = 4;
    }
    for (; step >= 1; step >>= 1) {
        __m256i at = _mm256_add_epi32(local, _mm256_set1_epi32(step - 1));
        __m256 t = _mm256_permutevar8x32_ps(s->lo, at);
        if (top == 15) t = _mm256_blendv_ps(t, _mm256_permutevar8x32_ps(s->hi, at), upper);
        __m256 below = strict ? _mm256_cmp_ps(t, y, _CMP_LT_OQ) : _mm256_cmp_ps(t, y, _CMP_LE_OQ);
        local = _mm256_add_epi32(local, _mm256_and_si256(_mm256_castps_si256(below), _mm256_set1_epi32(step)));
    }
    return vi_select(v_isnan(y), _mm256_set1_epi32(top), _mm256_add_epi32(pos, local));
}

static inline vcb_t vcb_init(const float *q, int bits) {
    vcb_t cb = {_mm256_setzero_ps(), _mm256_setzero_ps(), q};
    if (q && bits <= 4) {
        float t[16] = {0};
        memcpy(t, q, sizeof(float) << bits);
        cb.lo = _mm256_loadu_ps(t);
        cb.hi = _mm256_loadu_ps(t + 8);
    }
    return cb;
}

/* q[idx] for the 8 codes idx of a codebook of 2**bits entries. */
static inline vf vcb_lookup(const vcb_t *cb, vi idx, int bits) {
    if (bits <= 3) return _mm256_permutevar8x32_ps(cb->lo, idx);
    if (bits == 4)  /* bit 3 of the index, moved to the sign bit, picks the high register */
        return _mm256_blendv_ps(_mm256_permutevar8x32_ps(cb->lo, idx), _mm256_permutevar8x32_ps(cb->hi, idx),
                                _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
    return _mm256_castsi256_ps(lookup8_epi32((const int32_t *)cb->q, idx));
}

/* The entries of 8 8-bit codes: each lane read at its code byte, without unpacking the bytes into a vector
 * and out again (in L2: 0.8 cycles per element of the 8-bit dequantize, against 1.3 through v_unpack and
 * lookup8_epi32). simd.h's v_decode takes it for 8-bit codes. */
#define SIMD_DECODE8 1
static inline vf simd_decode8(const float *q, const uint8_t *k) {
    return _mm256_setr_ps(q[k[0]], q[k[1]], q[k[2]], q[k[3]], q[k[4]], q[k[5]], q[k[6]], q[k[7]]);
}

static inline vi v_mix32(vi x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846CA68Bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

#endif /* CKQ_SIMD_AVX2_H */
