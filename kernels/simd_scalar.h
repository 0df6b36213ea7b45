/* ckptq's SIMD layer, scalar part (see simd.h): the one-element form of every operation, as the contract
 * states it. Always included: the vector paths finish a block's last len % VL elements with these. When no
 * vector instruction set is selected (simd.h), the second half of this file is the layer itself, one
 * lane wide (VL 1), built on the same functions; so the scalar build is the contract's plain C.
 */
#ifndef CKQ_SIMD_SCALAR_H
#define CKQ_SIMD_SCALAR_H

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

/* The absmax of a block from the unsigned max of its bit patterns with the sign cleared: integer order
 * is value order for non-NaN floats and every NaN lies above +inf, so the max is NaN if any element is
 * (as torch's amax), and -0.0 counts as +0.0 (as abs().amax() gives). */
static inline float bits_to_absmax(uint32_t mx) { return mx > 0x7F800000u ? NAN : u2f(mx); }

/* The code table's answer for one y (see cpu_kernels.c's header): #{t < y}. ``table`` points at the
 * table's middle entry (bucket 0), so the signed top 16 bits index it directly. */
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

/* Code i of a block's bit stream. */
static inline int code_at(const uint8_t *codes, int i, int bits) {
    if (bits == 8) return codes[i];
    int bit = i * bits, k = bit >> 3, sh = bit & 7;
    int v = codes[k] >> sh;
    if (sh + bits > 8) v |= codes[k + 1] << (8 - sh);
    return v & ((1 << bits) - 1);
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

#endif /* CKQ_SIMD_SCALAR_H */

/* ---- The layer one lane wide: what simd.h builds on where no vector instruction set is selected ---- */
#if !CKQ_VECTOR_ISA && !defined(CKQ_SIMD_SCALAR_LAYER)
#define CKQ_SIMD_SCALAR_LAYER
#define VL 1
#define SIMD_ISA "scalar"
/* Codes of 4 and 2 bits from the code table: one load beats a search of the thresholds here. */
#define SIMD_SEARCH 0

typedef float vf;
typedef uint32_t vi;
typedef int vm;

static inline vf v_load(const float *p) { return *p; }
static inline void v_store(float *p, vf x) { *p = x; }
static inline vf v_load_n(const float *p, int n) { return n > 0 ? *p : 0.0f; }
static inline void v_store_n(float *p, vf x, int n) { if (n > 0) *p = x; }
static inline vf v_load_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
static inline vf v_load_f16(const uint16_t *p) { return f16_to_f32(*p); }
static inline void v_store_bf16(uint16_t *p, vf x) { *p = f32_to_bf16(x); }
static inline void v_store_f16(uint16_t *p, vf x) { *p = f32_to_f16(x); }
static inline vf v_set1(float x) { return x; }
static inline vf v_add(vf a, vf b) { return a + b; }
static inline vf v_sub(vf a, vf b) { return a - b; }
static inline vf v_mul(vf a, vf b) { return a * b; }
static inline vf v_div(vf a, vf b) { return a / b; }
static inline vf v_sqrt(vf a) { return sqrtf(a); }  /* -fno-math-errno: the IEEE instruction */
static inline vm v_lt(vf a, vf b) { return a < b; }
static inline vm v_le(vf a, vf b) { return a <= b; }
static inline vm v_isnan(vf a) { return a != a; }
static inline vf v_select(vm m, vf t, vf f) { return m ? t : f; }
static inline vi v_as_bits(vf x) { return f2u(x); }
static inline vf v_from_bits(vi x) { return u2f(x); }
static inline vf v_from_int(vi x) { return (float)(int32_t)x; }

static inline vi vi_set1(int32_t x) { return (uint32_t)x; }
static inline vi vi_iota(void) { return 0; }
static inline vi vi_load(const uint32_t *p) { return *p; }
static inline void vi_store(uint32_t *p, vi x) { *p = x; }
static inline vi vi_add(vi a, vi b) { return a + b; }
static inline vi vi_sub(vi a, vi b) { return a - b; }
static inline vi vi_and(vi a, vi b) { return a & b; }
static inline vi vi_or(vi a, vi b) { return a | b; }
static inline vi vi_xor(vi a, vi b) { return a ^ b; }
static inline vi vi_mullo(vi a, vi b) { return a * b; }
#define vi_srl(x, n) ((vi)(x) >> (n))
#define vi_sll(x, n) ((vi)(x) << (n))
#define vi_sra(x, n) ((vi)((int32_t)(x) >> (n)))
static inline vi vi_min(vi a, vi b) { return (int32_t)a < (int32_t)b ? a : b; }
static inline vi vi_max(vi a, vi b) { return (int32_t)a > (int32_t)b ? a : b; }
static inline vi vi_max_u(vi a, vi b) { return a > b ? a : b; }
static inline vm vi_ge(vi a, vi b) { return (int32_t)a >= (int32_t)b; }
static inline vi vi_select(vm m, vi t, vi f) { return m ? t : f; }
static inline vi vi_add_if(vi a, vm m, vi b) { return m ? a + b : a; }
static inline vi vi_sub_if(vi a, vm m, vi b) { return m ? a - b : a; }
static inline uint32_t vi_reduce_max_u(vi x) { return x; }

typedef struct { int unused; } vunpack_t;
static inline vunpack_t v_unpack_init(int bits) { vunpack_t u = {bits}; return u; }
static inline vi v_unpack(const vunpack_t *u, const uint8_t *codes, int i, int bits) {
    (void)u;
    return (vi)code_at(codes, i, bits);
}
static inline void v_pack(uint8_t *codes, int i, vi code, int bits) { put_code(codes, i, (int)code, bits); }

static inline vi v_nearest(vf y, const int32_t *table) { return (vi)nearest1(y, table); }

typedef struct { const float *r; } vsearch_t;
static inline vsearch_t v_search_init(const float *r, int top) { vsearch_t s = {r}; (void)top; return s; }
typedef struct { const float *q; } vcb_t;
static inline vsearch_t v_search_book(const vcb_t *cb, const float *q, int top) {
    vsearch_t s = {q ? q + 1 : 0};
    (void)cb, (void)top;
    return s;
}
static inline vi v_count(vf y, const vsearch_t *s, int top, int strict) {
    if (y != y) return (vi)top;
    vi n = 0;
    for (int k = 0; k < top; k++) n += strict ? s->r[k] < y : s->r[k] <= y;
    return n;
}
static inline vcb_t vcb_init(const float *q, int bits) { vcb_t cb = {q}; (void)bits; return cb; }
static inline vf vcb_lookup(const vcb_t *cb, vi idx, int bits) { (void)bits; return cb->q[idx]; }

static inline vi v_mix32(vi x) { return mix32(x); }

#endif /* the scalar layer */
