/* ckptq's SIMD layer: one set of vector operations per instruction set, and the blocks of the codec
 * (decode a block of codes, encode a block of values to nearest or stochastically, their hashes, dtype
 * conversion, absmax) written once over them. cpu_kernels.c builds quantize and dequantize, and the
 * steps' encodes, on these; a step written as decode -> elementwise rule -> encode builds on the same.
 *
 * The instruction set is the widest the compiler targets (the build's -march, which CKPTQ_NATIVE_MARCH
 * caps; predefined macros, so one source serves every machine):
 *   __AVX512F__                 simd_avx512.h  16 lanes (plus VBMI's 64-code decode where present)
 *   __AVX2__                    simd_avx2.h     8 lanes (F16C for fp16 where present)
 *   __aarch64__ && __ARM_NEON   simd_neon.h     4 lanes (little-endian: codes are packed as words)
 *   otherwise, or CKQ_SCALAR    simd_scalar.h   1 lane: the contract's plain C
 * simd_scalar.h's one-element functions are always there: every path finishes a block's last
 * len % VL elements with them, so a block of any length works on every path.
 *
 * Arithmetic contract (ckptq.kernels.contract; tests/kernels/test_quantize.py, tests/kernels/test_step*.py,
 * tests/kernels/test_*_driver.py): every
 * path gives the PyTorch reference's bits. So: each add, sub, mul, div and sqrt is one IEEE fp32
 * operation, rounded once, in the order the reference writes it (no FMA: -ffp-contract=off, and no fma
 * intrinsic anywhere); compares are ordered (false for NaN) unless named otherwise; NaN payloads are not
 * part of the contract (a conversion may quiet a signalling NaN).
 *
 * What each simd_<isa>.h defines (vf: fp32 lanes, vi: 32-bit integer lanes, vm: a lane mask):
 *   VL, SIMD_ISA (its name), SIMD_SEARCH (1: find codes of 4 and 2 bits by v_count in registers rather
 *     than from the code table)
 *   vf v_load(p), v_store(p, x), v_load_n(p, n), v_store_n(p, x, n) (n < VL lanes; v_load_n zeroes the rest)
 *   vf v_load_bf16(p), v_load_f16(p); v_store_bf16(p, x), v_store_f16(p, x): VL 16-bit floats <-> fp32,
 *     as bf16_to_f32 / f16_to_f32 / f32_to_bf16 / f32_to_f16 (round to nearest even)
 *   vf v_set1(x), v_add, v_sub, v_mul, v_div, v_sqrt (IEEE); vm v_lt, v_le, v_isnan; vf v_select(m, t, f)
 *   vi v_as_bits(vf), vf v_from_bits(vi), vf v_from_int(vi) (signed)
 *   vi vi_set1, vi_iota (0 .. VL - 1), vi_load, vi_store, vi_add, vi_sub, vi_and, vi_or, vi_xor, vi_mullo
 *     (mod 2^32), vi_srl / vi_sll / vi_sra(x, constant), vi_min / vi_max (signed), vi_max_u (unsigned),
 *     vm vi_ge (signed), vi_select(m, t, f), vi_add_if(a, m, b) / vi_sub_if (a +- b where m), uint32_t
 *     vi_reduce_max_u
 *   vunpack_t v_unpack_init(bits); vi v_unpack(&u, codes, i, bits): the codes of elements i .. i + VL - 1
 *     of a block's bit stream (i a multiple of VL) as lanes; v_pack(codes, i, code, bits): the inverse,
 *     writing exactly VL * bits / 8 bytes (every path's VL is a multiple of 4, so they are whole bytes)
 *   vi v_nearest(y, table): the code table's answer, #{t < y} (nearest1 on VL lanes)
 *   vsearch_t v_search_init(r, top): a sorted run r[0 .. top - 1] (top = 2**bits - 1 <= 15) held for
 *     v_count(y, &s, top, strict) = #{k : r[k] < y} (strict) or <= y, NaN -> top; v_search_book(&cb, q,
 *     top): the run q[1 .. top] of a codebook
 *   vcb_t vcb_init(q, bits); vf vcb_lookup(&cb, idx, bits): q[idx] on a codebook of 2**bits entries
 *   vi v_mix32(x): contract.mix32 on every lane
 *   optionally SIMD_DECODE_WIDE with simd_decode_extra_t, simd_decode_extra_init and simd_decode_wide:
 *     a wider first loop for decode_block (AVX-512: 32 nibbles or, with VBMI, 64 bytes at a time); and
 *     SIMD_DECODE8 with simd_decode8(q, codes): VL 8-bit codes' entries, for v_decode (AVX2)
 *
 * Written once here, for every path: v_uniform, v_stochastic(_up), hashes, absbits_max / block_absmax,
 * load_block / store_block, vdecode_init / v_decode / decode_block, vencode_init / encode_prepared /
 * encode_block / encode_nearest8_pair.
 */
#ifndef CKQ_SIMD_H
#define CKQ_SIMD_H
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };  /* the dtypes of params, grads and quantize's input */

/* A vector path where the target has one (CKQ_SCALAR: the scalar one regardless). */
#if defined(CKQ_SCALAR)
#define CKQ_VECTOR_ISA 0
#elif defined(__AVX512F__) || defined(__AVX2__) || \
    (defined(__aarch64__) && defined(__ARM_NEON) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__)
#define CKQ_VECTOR_ISA 1
#else
#define CKQ_VECTOR_ISA 0
#endif
#include "simd_scalar.h"  /* the one-element functions; without a vector path, the layer one lane wide too */
#if !CKQ_VECTOR_ISA
#elif defined(__AVX512F__)
#include "simd_avx512.h"
#elif defined(__AVX2__)
#include "simd_avx2.h"
#else
#include "simd_neon.h"
#endif

#define SIMD_INLINE static inline __attribute__((always_inline))

#ifndef SIMD_NEIGHBOURS
#define SIMD_NEIGHBOURS 0  /* the path's simd_neighbours reads a neighbour table (AVX2) */
#endif
#ifndef SIMD_DECODE8
#define SIMD_DECODE8 0
static inline vf simd_decode8(const float *q, const uint8_t *k) { (void)k; return v_set1(q[0]); }  /* not called */
#endif
#ifndef SIMD_DECODE_WIDE
typedef struct { int unused; } simd_decode_extra_t;
static inline void simd_decode_extra_init(simd_decode_extra_t *x, const float *q, int bits) {
    (void)x, (void)q, (void)bits;
}
static inline int simd_decode_wide(const simd_decode_extra_t *x, const vcb_t *cb, const uint8_t *c, int len, int bits,
                                   vf va, int square, float *o) {
    (void)x, (void)cb, (void)c, (void)len, (void)bits, (void)va, (void)square, (void)o;
    return 0;
}
#endif

/* ---- Stochastic rounding (ckptq.kernels.contract) ---- */

/* uniform1 of the VL hashes at h. */
SIMD_INLINE vf v_uniform(const uint32_t *h, int high) {
    vi x = vi_load(h);
    x = high ? vi_srl(x, 16) : vi_and(x, vi_set1(0xFFFF));
    return v_mul(v_from_int(x), v_set1(0x1p-16f));
}

/* The contract's stochastic rounding from lo (the entry at or below y, clamped to 0 .. K - 1): lo + 1 with
 * probability (y - q[lo]) / (q[lo + 1] - q[lo]), top stays top. q: the codebook, u: the lanes' uniforms. */
SIMD_INLINE vi v_stochastic_up(vf y, vi lo, const vcb_t *q, vf u, int bits) {
    const int top = (1 << bits) - 1;
    const vi one = vi_set1(1), vtop = vi_set1(top);
    vm at_top = vi_ge(lo, vtop);
    vf q_lo = vcb_lookup(q, lo, bits);
    vf q_hi = vcb_lookup(q, vi_min(vi_add(lo, one), vtop), bits);
    vm up = v_lt(v_mul(u, v_sub(q_hi, q_lo)), v_sub(y, q_lo));
    return vi_select(at_top, vtop, vi_add_if(lo, up, one));
}

/* stochastic1 on VL lanes, from the nearest code c. */
SIMD_INLINE vi v_stochastic(vf y, vi c, const vcb_t *q, vf u, int bits) {
    vi lo = vi_sub_if(c, v_lt(y, vcb_lookup(q, c, bits)), vi_set1(1));
    return v_stochastic_up(y, vi_max(lo, vi_set1(0)), q, u, bits);
}

#if SIMD_NEIGHBOURS
/* v_stochastic on an 8-bit codebook, its entries read from the neighbour table nb (simd_neighbours):
 * lo = max(c - (y < q[c]), 0), then v_stochastic_up's rule with q[lo] and q[min(lo + 1, top)], the same
 * values and arithmetic. */
SIMD_INLINE vi v_stochastic_nb(vf y, vi c, const float *nb, vf u) {
    const vi zero = vi_set1(0), one = vi_set1(1), vtop = vi_set1(255);
    vf q_below, q_at, q_above;
    simd_neighbours(nb, c, &q_below, &q_at, &q_above);
    vm lower = v_lt(y, q_at);                      /* lo = c - 1 (clamped at 0) */
    vf q_lo = v_select(lower, q_below, q_at);      /* at c = 0 the table's q[c - 1] is q[0] */
    vf q_hi = v_select(lower, v_select(vi_ge(zero, c), q_above, q_at), q_above);  /* lo = 0 from c = 0: q[1] */
    vi lo = vi_max(vi_sub_if(c, lower, one), zero);
    vm up = v_lt(v_mul(u, v_sub(q_hi, q_lo)), v_sub(y, q_lo));
    return vi_select(vi_ge(lo, vtop), vtop, vi_add_if(lo, up, one));
}
#endif

/* h[k] = mix32((i0 + k) mod 2^32 ^ seed) for k < len: the stochastic rounding's hashes of the elements
 * i0 .. i0 + len - 1 (their indices in the parameter). */
static inline void hashes(uint32_t *h, int len, int64_t i0, uint32_t seed) {
    int k = 0;
    const vi iota = vi_iota();
    for (; k + VL <= len; k += VL) {
        vi idx = vi_add(vi_set1((int32_t)(uint32_t)(i0 + k)), iota);
        vi_store(h + k, v_mix32(vi_xor(idx, vi_set1((int32_t)seed))));
    }
    for (; k < len; k++) h[k] = mix32((uint32_t)(i0 + k) ^ seed);
}

/* ---- Blocks of fp32 values ---- */

/* acc and the bits of x with the sign cleared, lane by lane the larger (unsigned): bits_to_absmax of
 * the reduced maximum is the absmax of every value seen. */
SIMD_INLINE vi v_absbits_max(vi acc, vf x) { return vi_max_u(acc, vi_and(v_as_bits(x), vi_set1(0x7FFFFFFF))); }

/* The unsigned max of x[0 .. len)'s bits with the sign cleared (bits_to_absmax makes it the absmax). */
static inline uint32_t absbits_max(const float *x, int len) {
    int i = 0;
    vi acc = vi_set1(0);
    for (; i + VL <= len; i += VL) acc = v_absbits_max(acc, v_load(x + i));
    uint32_t mx = vi_reduce_max_u(acc);
    for (; i < len; i++) {
        uint32_t a = f2u(x[i]) & 0x7FFFFFFFu;
        mx = a > mx ? a : mx;
    }
    return mx;
}

/* max |x| of a block, NaN if any element is NaN (as torch's amax), +0.0 for -0.0 (as abs().amax()). */
static inline float block_absmax(const float *x, int len) { return bits_to_absmax(absbits_max(x, len)); }

/* buf[i] = src[off + i] as fp32 (sqrt applied when asked), src of dtype F32, BF16 or F16. */
static void load_block(const void *src, int64_t off, int len, int dtype, int sqrt_transform, float *buf) {
    int i = 0;
    if (dtype == F32) {  /* no memcpy: a call out would make the steps that call this save every vector register */
        const float *s = (const float *)src + off;
        if (sqrt_transform)
            for (; i + VL <= len; i += VL) v_store(buf + i, v_sqrt(v_load(s + i)));
        else
            for (; i + VL <= len; i += VL) v_store(buf + i, v_load(s + i));
        for (; i < len; i++) buf[i] = sqrt_transform ? sqrtf(s[i]) : s[i];
        return;
    }
    const uint16_t *s = (const uint16_t *)src + off;
#define LOAD16(VLOAD, ONE)                                                                        \
    do {                                                                                          \
        if (sqrt_transform)                                                                       \
            for (; i + VL <= len; i += VL) v_store(buf + i, v_sqrt(VLOAD(s + i)));                \
        else                                                                                      \
            for (; i + VL <= len; i += VL) v_store(buf + i, VLOAD(s + i));                        \
        for (; i < len; i++) buf[i] = sqrt_transform ? sqrtf(ONE(s[i])) : ONE(s[i]);              \
    } while (0)
    if (dtype == BF16)
        LOAD16(v_load_bf16, bf16_to_f32);
    else
        LOAD16(v_load_f16, f16_to_f32);
#undef LOAD16
}

/* buf[0 .. len) back into dst[off ..] as a 16-bit float dtype (BF16 / F16), rounding to nearest even. */
static void store_block(void *dst, int64_t off, int len, int dtype, const float *buf) {
    uint16_t *d = (uint16_t *)dst + off;
    int i = 0;
    if (dtype == BF16) {
        for (; i + VL <= len; i += VL) v_store_bf16(d + i, v_load(buf + i));
        for (; i < len; i++) d[i] = f32_to_bf16(buf[i]);
    } else {
        for (; i + VL <= len; i += VL) v_store_f16(d + i, v_load(buf + i));
        for (; i < len; i++) d[i] = f32_to_f16(buf[i]);
    }
}

/* ---- Decoding: codes -> fp32 ---- */

/* A codebook prepared for decoding: q (256 entries, a smaller codebook padded with zeros, so that table
 * reads stay in bounds whatever the width) as the path looks it up, the unpacker of its width, and what
 * the path's wide loop needs. Prepared once per call (vdecode_init), read by every block. */
typedef struct {
    vcb_t cb;
    vunpack_t u;
    const float *q;
    simd_decode_extra_t extra;
} vdecode_t;

static inline void vdecode_init(vdecode_t *d, const float *qmap, int bits) {
    d->cb = vcb_init(qmap, bits);
    d->u = v_unpack_init(bits);
    d->q = qmap;
    simd_decode_extra_init(&d->extra, qmap, bits);
}

/* q[code] of elements i .. i + VL - 1 (i a multiple of VL) of the block whose codes start at c (8-bit codes
 * straight from their bytes where the path says that is faster: SIMD_DECODE8). */
SIMD_INLINE vf v_decode(const vdecode_t *d, const uint8_t *c, int i, int bits) {
    if (SIMD_DECODE8 && bits == 8) return simd_decode8(d->q, c + i);
    return vcb_lookup(&d->cb, v_unpack(&d->u, c, i, bits), bits);
}

/* out[i] = q[code i] * scale for i < len (squared when ``square``: the sqrt transform's decode), codes
 * ``bits`` wide from c (a block: starts on a byte). Always inlined: with constant bits and square the
 * loop has no branch on them. */
SIMD_INLINE void decode_block(const vdecode_t *d, const uint8_t *c, int len, int bits, float scale, int square,
                              float *out) {
    const vf va = v_set1(scale);
    int i = simd_decode_wide(&d->extra, &d->cb, c, len, bits, va, square, out);
    for (; i + VL <= len; i += VL) {
        vf v = v_mul(v_decode(d, c, i, bits), va);
        v_store(out + i, square ? v_mul(v, v) : v);
    }
    for (; i < len; i++) {
        float v = d->q[code_at(c, i, bits)] * scale;
        out[i] = square ? v * v : v;
    }
}

/* ---- Encoding: fp32 -> codes ---- */

/* What encoding on one codebook needs, prepared once (vencode_init) for any number of blocks: the code table
 * (at its middle; see cpu_kernels.c's header), for 4 and 2 bits where the path searches in registers
 * (SIMD_SEARCH) the thresholds thr15 held for v_count, and for stochastic rounding the codebook q itself
 * (lookups, and its entries 1 .. top for v_count). */
typedef struct {
    const int32_t *table;
    const float *q;     /* NULL: to nearest */
    int in_register;    /* codes of 4 and 2 bits from the thresholds in registers, not the table */
    vcb_t cb;
    vsearch_t thr, up;  /* the thresholds; the codebook's entries 1 .. top */
#if SIMD_NEIGHBOURS
    float nb[256 * 4] __attribute__((aligned(16)));  /* an 8-bit codebook's neighbour table (stochastic) */
#endif
} vencode_t;

SIMD_INLINE void vencode_init(vencode_t *e, const int32_t *table, const float *thr15, const float *q, int bits) {
    const int top = (1 << bits) - 1;
    e->table = table;
    e->q = q;
    e->in_register = SIMD_SEARCH && bits <= 4 && thr15;
    e->cb = vcb_init(q, bits);
    e->thr = v_search_init(e->in_register ? thr15 : 0, top);
    e->up = v_search_book(&e->cb, SIMD_SEARCH && bits <= 4 ? q : 0, top);
#if SIMD_NEIGHBOURS
    if (q && bits == 8)
        for (int k = 0; k < 256; k++) {
            e->nb[4 * k] = q[k > 0 ? k - 1 : 0];
            e->nb[4 * k + 1] = q[k];
            e->nb[4 * k + 2] = q[k < 255 ? k + 1 : 255];
            e->nb[4 * k + 3] = 0.0f;
        }
#endif
}

/* code i = #{t < x[i] / safe} (to nearest), packed as put_code does; with the codebook q (stochastic
 * rounding, ckptq.kernels.contract) the code is then rounded stochastically instead, with the uniforms of
 * hashes h (their high halves when ``high``). Always inlined, so that callers with constant arguments get
 * a loop without the other cases' branches. */
SIMD_INLINE void encode_prepared(const vencode_t *e, const float *x, int len, float absmax, uint8_t *codes, int bits,
                                 const uint32_t *h, int high) {
    const int top = (1 << bits) - 1;
    const float *q = e->q;
    float safe = absmax > 0.0f ? absmax : 1.0f;  /* NaN > 0 is false: a NaN block divides by 1 */
    int i = 0;
    const vf vsafe = v_set1(safe);
    for (; i + VL <= len; i += VL) {
        vf y = v_div(v_load(x + i), vsafe);
        vi code;
        if (SIMD_SEARCH && q && bits <= 4)  /* no nearest code needed: for y not NaN the contract's lo = clamp(c
                                             * - (y < q[c]), 0, K - 1) is #{j >= 1 : q[j] <= y} (q[c - 1] < y <
                                             * q[c + 1]); a NaN counts K - 1, the top code, as the contract's
                                             * c = K - 1 gives it */
            code = v_stochastic_up(y, v_count(y, &e->up, top, 0), &e->cb, v_uniform(h + i, high), bits);
        else {
            code = e->in_register ? v_count(y, &e->thr, top, 1) : v_nearest(y, e->table);
#if SIMD_NEIGHBOURS
            if (q && bits == 8) code = v_stochastic_nb(y, code, e->nb, v_uniform(h + i, high));
            else
#endif
            if (q) code = v_stochastic(y, code, &e->cb, v_uniform(h + i, high), bits);
        }
        v_pack(codes, i, code, bits);
    }
    for (; i < len; i++) {  /* the vector loop stops at a multiple of VL: on a byte */
        float y = x[i] / safe;
        int code = nearest1(y, e->table);
        put_code(codes, i, q ? stochastic1(y, code, q, top, uniform1(h[i], high)) : code, bits);
    }
}

/* encode_prepared of one block, its encoder prepared here: the code table (at its middle), the thresholds
 * thr15 for 4 and 2 bits (or NULL: the table serves them too), the codebook q (NULL: to nearest). */
SIMD_INLINE void encode_block(const float *x, int len, float absmax, const int32_t *table, uint8_t *codes, int bits,
                              const float *q, const uint32_t *h, int high, const float *thr15) {
    vencode_t e;
    vencode_init(&e, table, thr15, q, bits);
    encode_prepared(&e, x, len, absmax, codes, bits, h, high);
}

/* 8-bit codes to nearest of two blocks in one loop (the step's ratio and sqrt(v), each with its scale and code
 * table): two independent table reads in flight and one loop's overhead instead of two
 * (tools/bench/cpu_kernels.py measures the step with it). */
static inline void encode_nearest8_pair(const float *x0, const float *x1, int len, float absmax0, float absmax1,
                                 const int32_t *table0, const int32_t *table1, uint8_t *codes0, uint8_t *codes1) {
    float safe0 = absmax0 > 0.0f ? absmax0 : 1.0f, safe1 = absmax1 > 0.0f ? absmax1 : 1.0f;
    int i = 0;
    const vf vsafe0 = v_set1(safe0), vsafe1 = v_set1(safe1);
    for (; i + VL <= len; i += VL) {
        vi c0 = v_nearest(v_div(v_load(x0 + i), vsafe0), table0);
        vi c1 = v_nearest(v_div(v_load(x1 + i), vsafe1), table1);
        v_pack(codes0, i, c0, 8);
        v_pack(codes1, i, c1, 8);
    }
    for (; i < len; i++) {
        codes0[i] = (uint8_t)nearest1(x0[i] / safe0, table0);
        codes1[i] = (uint8_t)nearest1(x1[i] / safe1, table1);
    }
}

#endif /* CKQ_SIMD_H */
