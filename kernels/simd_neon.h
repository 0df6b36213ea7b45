/* ckptq's SIMD layer on aarch64 Advanced SIMD (NEON; see simd.h): 4 fp32 lanes, lane masks as all-ones
 * lanes. NEON is part of every aarch64 CPU (ARMv8-A), and aarch64's vector division and square root are
 * IEEE (correctly rounded; Linux leaves FPCR's flush-to-zero off), which 32-bit ARM NEON's are not: so
 * this path is aarch64 only.
 *
 * What NEON lacks beside AVX-512, and what stands in for it here:
 * - no gather: the 256 KB code table and the 64- and 256-entry codebooks are read one lane at a time;
 * - codebooks of up to 16 fp32 entries (64 bytes) are looked up with one tbl over their bytes (each
 *   index i becomes the byte indices 4i .. 4i + 3);
 * - sorted runs of thresholds are counted, not searched: 15 (or 3) compares and subtractions, every
 *   one independent of the others;
 * - 4 codes of ``bits`` bits are bits / 2 whole bytes at every width: unpacked from one 32-bit word by a
 *   per-lane shift, packed by shifting each code to its place and adding the lanes (addv).
 */
#ifndef CKQ_SIMD_NEON_H
#define CKQ_SIMD_NEON_H
#include <arm_neon.h>

#define VL 4
#define SIMD_ISA "neon"
#define SIMD_SEARCH 1  /* codes of 4 and 2 bits by counting the thresholds held in registers */

typedef float32x4_t vf;
typedef uint32x4_t vi;
typedef uint32x4_t vm;  /* all-ones lanes where true */

static inline vf v_load(const float *p) { return vld1q_f32(p); }
static inline void v_store(float *p, vf x) { vst1q_f32(p, x); }
static inline vf v_load_n(const float *p, int n) {
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    memcpy(t, p, (size_t)n * sizeof(float));
    return vld1q_f32(t);
}
static inline void v_store_n(float *p, vf x, int n) {
    float t[4];
    vst1q_f32(t, x);
    memcpy(p, t, (size_t)n * sizeof(float));
}
static inline vf v_load_bf16(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
/* fcvtl: exact, as f16_to_f32 (a signalling NaN comes out quiet: NaN payloads are not in the contract). */
static inline vf v_load_f16(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
static inline vf v_set1(float x) { return vdupq_n_f32(x); }
static inline vf v_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf v_sub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf v_mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf v_div(vf a, vf b) { return vdivq_f32(a, b); }
static inline vf v_sqrt(vf a) { return vsqrtq_f32(a); }
static inline vm v_lt(vf a, vf b) { return vcltq_f32(a, b); }
static inline vm v_le(vf a, vf b) { return vcleq_f32(a, b); }
static inline vm v_isnan(vf a) { return vmvnq_u32(vceqq_f32(a, a)); }
static inline vf v_select(vm m, vf t, vf f) { return vbslq_f32(m, t, f); }
static inline vi v_as_bits(vf x) { return vreinterpretq_u32_f32(x); }
static inline vf v_from_bits(vi x) { return vreinterpretq_f32_u32(x); }
static inline vf v_from_int(vi x) { return vcvtq_f32_s32(vreinterpretq_s32_u32(x)); }

static inline vi vi_set1(int32_t x) { return vdupq_n_u32((uint32_t)x); }
static inline vi vi_iota(void) {
    static const uint32_t iota[4] = {0, 1, 2, 3};
    return vld1q_u32(iota);
}
static inline vi vi_load(const uint32_t *p) { return vld1q_u32(p); }
static inline void vi_store(uint32_t *p, vi x) { vst1q_u32(p, x); }
static inline vi vi_add(vi a, vi b) { return vaddq_u32(a, b); }
static inline vi vi_sub(vi a, vi b) { return vsubq_u32(a, b); }
static inline vi vi_and(vi a, vi b) { return vandq_u32(a, b); }
static inline vi vi_or(vi a, vi b) { return vorrq_u32(a, b); }
static inline vi vi_xor(vi a, vi b) { return veorq_u32(a, b); }
static inline vi vi_mullo(vi a, vi b) { return vmulq_u32(a, b); }
/* macros: the shift counts must be immediates */
#define vi_srl(x, n) vshrq_n_u32((x), (n))
#define vi_sll(x, n) vshlq_n_u32((x), (n))
#define vi_sra(x, n) vreinterpretq_u32_s32(vshrq_n_s32(vreinterpretq_s32_u32(x), (n)))
#define AS_S32(x) vreinterpretq_s32_u32(x)
static inline vi vi_min(vi a, vi b) { return vreinterpretq_u32_s32(vminq_s32(AS_S32(a), AS_S32(b))); }
static inline vi vi_max(vi a, vi b) { return vreinterpretq_u32_s32(vmaxq_s32(AS_S32(a), AS_S32(b))); }
static inline vi vi_max_u(vi a, vi b) { return vmaxq_u32(a, b); }
static inline vm vi_ge(vi a, vi b) { return vcgeq_s32(AS_S32(a), AS_S32(b)); }
static inline vi vi_select(vm m, vi t, vi f) { return vbslq_u32(m, t, f); }
static inline vi vi_add_if(vi a, vm m, vi b) { return vaddq_u32(a, vandq_u32(m, b)); }
static inline vi vi_sub_if(vi a, vm m, vi b) { return vsubq_u32(a, vandq_u32(m, b)); }
static inline uint32_t vi_reduce_max_u(vi x) { return vmaxvq_u32(x); }

/* f32 -> bf16 as f32_to_bf16 (round to nearest even on the bits, NaN -> 0x7FC0); f32 -> f16 with fcvtn,
 * which rounds to nearest even (FPCR's default), gives inf from 65520 up and keeps a NaN's top payload
 * bits with the quiet bit set, as f32_to_f16. */
static inline void v_store_bf16(uint16_t *p, vf x) {
    vi u = vreinterpretq_u32_f32(x);
    vi r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)), vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1))), 16);
    r = vbslq_u32(v_isnan(x), vdupq_n_u32(0x7FC0), r);
    vst1_u16(p, vmovn_u32(r));
}
static inline void v_store_f16(uint16_t *p, vf x) { vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x))); }

/* Unpacking 4 codes: each lane's right shift (as a negative left shift) and the code mask. */
typedef struct { int32x4_t sh; vi mask; } vunpack_t;

static inline vunpack_t v_unpack_init(int bits) {
    const int32_t sh[4] = {0, -bits, -2 * bits, -3 * bits};
    vunpack_t u = {vld1q_s32(sh), vdupq_n_u32((1u << bits) - 1)};
    return u;
}

/* The codes of elements i .. i + 3 (i a multiple of 4): their bits / 2 bytes as one word, shifted per lane. */
static inline vi v_unpack(const vunpack_t *u, const uint8_t *codes, int i, int bits) {
    uint32_t w = 0;
    memcpy(&w, codes + i * bits / 8, bits / 2);
    return vandq_u32(vshlq_u32(vdupq_n_u32(w), u->sh), u->mask);
}

/* Codes of elements i .. i + 3 (i a multiple of 4) into the bit stream: exactly bits / 2 bytes. */
static inline void v_pack(uint8_t *codes, int i, vi code, int bits) {
    const int32_t sh[4] = {0, bits, 2 * bits, 3 * bits};
    uint32_t w = vaddvq_u32(vshlq_u32(code, vld1q_s32(sh)));  /* the codes do not overlap: add is or */
    memcpy(codes + i * bits / 8, &w, bits / 2);
}

/* nearest1 on 4 lanes: four table reads, then the rank (the low 16 bits, flipped for negative y) and an add. */
static inline vi v_nearest(vf y, const int32_t *table) {
    vi ybits = vreinterpretq_u32_f32(y);
    int32x4_t idx = vshrq_n_s32(vreinterpretq_s32_u32(ybits), 16);
    const uint32_t e[4] = {(uint32_t)table[vgetq_lane_s32(idx, 0)], (uint32_t)table[vgetq_lane_s32(idx, 1)],
                           (uint32_t)table[vgetq_lane_s32(idx, 2)], (uint32_t)table[vgetq_lane_s32(idx, 3)]};
    vi rank = vandq_u32(veorq_u32(ybits, vi_sra(ybits, 31)), vdupq_n_u32(0xFFFF));
    return vshrq_n_u32(vaddq_u32(vld1q_u32(e), rank), 17);
}

/* A sorted run of up to 15 entries, each in every lane of its register. */
typedef struct { float32x4_t t[15]; } vsearch_t;
/* A codebook of up to 16 entries as 64 bytes for tbl, or a larger one read from q. */
typedef struct { uint8x16x4_t bytes; const float *q; } vcb_t;

static inline vsearch_t v_search_init(const float *r, int top) {
    vsearch_t s;
    for (int k = 0; k < 15; k++) s.t[k] = vdupq_n_f32(r && k < top ? r[k] : 0.0f);
    return s;
}

static inline vsearch_t v_search_book(const vcb_t *cb, const float *q, int top) {
    (void)cb;
    return v_search_init(q ? q + 1 : 0, top);
}

/* #{k < top : r[k] < y} (strict) or <= y; a NaN y counts top. Each true compare is -1: subtracted. */
static inline vi v_count(vf y, const vsearch_t *s, int top, int strict) {
    vi n = vdupq_n_u32(0);
    for (int k = 0; k < top; k++) n = vsubq_u32(n, strict ? vcltq_f32(s->t[k], y) : vcleq_f32(s->t[k], y));
    return vbslq_u32(v_isnan(y), vdupq_n_u32((uint32_t)top), n);
}

static inline vcb_t vcb_init(const float *q, int bits) {
    float t[16] = {0};
    if (q && bits <= 4) memcpy(t, q, sizeof(float) << bits);
    vcb_t cb = {{{vreinterpretq_u8_f32(vld1q_f32(t)), vreinterpretq_u8_f32(vld1q_f32(t + 4)),
                  vreinterpretq_u8_f32(vld1q_f32(t + 8)), vreinterpretq_u8_f32(vld1q_f32(t + 12))}}, q};
    return cb;
}

/* q[idx] for the 4 codes idx of a codebook of 2**bits entries. */
static inline vf vcb_lookup(const vcb_t *cb, vi idx, int bits) {
    if (bits <= 4) {
        uint8x16_t at = vreinterpretq_u8_u32(vaddq_u32(vmulq_n_u32(idx, 0x04040404u), vdupq_n_u32(0x03020100u)));
        return vreinterpretq_f32_u8(bits <= 2 ? vqtbl1q_u8(cb->bytes.val[0], at) : vqtbl4q_u8(cb->bytes, at));
    }
    const float e[4] = {cb->q[vgetq_lane_u32(idx, 0)], cb->q[vgetq_lane_u32(idx, 1)], cb->q[vgetq_lane_u32(idx, 2)],
                        cb->q[vgetq_lane_u32(idx, 3)]};
    return vld1q_f32(e);
}

static inline vi v_mix32(vi x) {
    x = veorq_u32(x, vshrq_n_u32(x, 16));
    x = vmulq_u32(x, vdupq_n_u32(0x7FEB352Du));
    x = veorq_u32(x, vshrq_n_u32(x, 15));
    x = vmulq_u32(x, vdupq_n_u32(0x846CA68Bu));
    return veorq_u32(x, vshrq_n_u32(x, 16));
}

#endif /* CKQ_SIMD_NEON_H */
