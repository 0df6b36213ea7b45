/* The one step of every optimizer (ckptq.kernels.contract.Group / Dense) in C: decode -> rule -> encode,
 * written once here over the SIMD layer, for every rule of step_rules.h. Included by cpu_kernels.c, after
 * the codec (rows_t and the layout helpers are its).
 *
 *   ckq_step_group   <-> ckptq.kernels.step_torch.step_group (each member in turn, bit for bit)
 *   ckq_dense_group  <-> ckptq.kernels.step_torch.dense_group
 *
 * Per block of a member: each slot's codes are decoded into a scratch row (qmap[code] * scale: the layer's
 * decode_block, one loop per code width); one loop then takes VL elements at a time through the slots'
 * decode transforms (SQRT squares the stored value, RATIO multiplies it by its divisor's stored value plus
 * decode_eps), the rule, and the encode transforms (SQRT: the square root; RATIO: over the divisor's new
 * stored value plus encode_eps), writing the new stored values back to the scratch rows and keeping each
 * slot's largest magnitude; the new scale of each slot follows, then its codes (the layer's encode: to
 * nearest, or stochastically for a seeded slot of a call with seeds, slot j's uniforms as
 * contract.slot_uniforms draws them). A block's last len % VL elements take the same loop body as one
 * partial vector (v_load_n / v_store_n), so each rule is one function for the whole block on every path.
 *
 * That loop is compiled once per rule and flag word (the rule's switches constant: no branch on them per
 * element), with the slots' transforms inlined as the rule declares them (step_rules.h's CKQ_RULES); a
 * group whose states are stored otherwise (a first moment of an older file, not yet a ratio) runs the same
 * rule with the transforms as passes of their own over the scratch rows. Code widths are handled outside
 * that loop, by the decode and encode of each slot, one loop per width.
 *
 * Threads: one call per thread, all threads of a call sharing ``next`` (set to 0 by the caller): each takes
 * work items (member, first block, end block) from it until none are left, so that hundreds of small
 * members and a few huge ones balance alike. The fp32 (dense) step works the same way on element ranges.
 */
#ifndef CKQ_STEP_H
#define CKQ_STEP_H
#include "step_rules.h"

#define MAX_SLOTS 3
#define MAX_FIELDS 16
enum { TR_NONE = 0, TR_SQRT = 1, TR_RATIO = 2 };  /* contract.NONE, SQRT, RATIO */

/* One state slot as all members of a group store it (backend_native's SlotConfig mirrors it). */
typedef struct {
    const float *decode;        /* fp32 [256]: the stored codes' codebook (a smaller one padded with zeros) */
    const int32_t *table;       /* int32 [65536]: code table of the new codes' codebook (its midpoints) */
    const int32_t *floor_table; /* int32 [65536] or NULL: code table of #{k >= 1 : q[k] <= y} (lut.floor_table) */
    const float *thresholds;    /* fp32 [2**bits - 1]: the new codebook's midpoints */
    const float *encode;        /* fp32 [2**bits]: the new codes' codebook (stochastic rounding reads it) */
    int32_t bits;               /* 8, 6, 4 or 2 */
    int32_t decode_as, encode_as, divisor;  /* the stored and the new codes' transforms; RATIO: relative to */
    int32_t seeded;             /* rounds stochastically in a call with seeds */
} slot_config_t;

/* What a group's members share (backend_native's StepConfig mirrors it). */
typedef struct {
    slot_config_t slot[MAX_SLOTS];
    int32_t rule;               /* CKQ_RULES' id (ckq_rule_id) */
    int32_t flags;              /* rules.MAXIMIZE | the rule's switches */
    int32_t slots;              /* the rule's slot count for these flags */
    int32_t block;              /* 1..4096 */
    int32_t pdtype, gdtype;     /* F32, BF16, F16 */
    int32_t fields;             /* len(rule.fields): the hyper row's length */
    int32_t dec_eps, enc_eps;   /* the fields of decode_eps / encode_eps (-1: none; read by RATIO slots) */
} step_config_t;

/* One member: its param and its slots' codes and scales in rows of row_len (eight 64-bit words:
 * backend_native packs a group's members into one int64 array [members, 8]). */
typedef struct {
    void *p;             /* [n] of pdtype, updated in place (read only where the rule writes d) */
    uint8_t *codes[3];   /* per slot: [rows * row_bytes(bits)], rewritten in place */
    float *absmax[3];    /* per slot: [rows * blocks_per_row], rewritten in place */
    int64_t row_len;
} member_t;

/* What every call passes beside its config: members' tables, this call's gradients (addresses, as int64),
 * outs (the direction's fp32 arrays, or NULL), hyper rows (fp32 [members, fields]), seeds (NULL: nearest). */
typedef struct {
    const void *members;
    const int64_t *grads, *outs;
    const float *hyper;
    const int64_t *seeds;
} step_call_t;

/* ---- What the rule table says of a rule (constants where the rule id is one) ---- */

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE void apply_rule(int rule, const vf *h, const float *hs, int flags, vf g, vf *p, vf *s, vf *d) {
    switch (rule) {
#define RULE_CALL(ID, NAME, FN, ...) case ID: FN(h, hs, flags, g, p, s, d); break;
        CKQ_RULES(RULE_CALL)
#undef RULE_CALL
    }
}

ALWAYS_INLINE int rule_slots(int rule, int flags) {
    switch (rule) {
#define RULE_SLOTS(ID, NAME, FN, SWITCHES, SLOTS, ...) case ID: return SLOTS(flags);
        CKQ_RULES(RULE_SLOTS)
#undef RULE_SLOTS
    }
    return -1;
}

ALWAYS_INLINE int rule_writes_d(int rule, int flags) {
    switch (rule) {
#define RULE_WRITES(ID, NAME, FN, SWITCHES, SLOTS, WRITES, ...) case ID: return WRITES(flags);
        CKQ_RULES(RULE_WRITES)
#undef RULE_WRITES
    }
    return 0;
}

/* The flags a rule's code depends on: its switches (bits 1 .. SWITCHES). */
ALWAYS_INLINE int rule_switches(int rule, int flags) {
    switch (rule) {
#define RULE_MASK(ID, NAME, FN, SWITCHES, ...) case ID: return flags & ((1 << (SWITCHES + 1)) - 2);
        CKQ_RULES(RULE_MASK)
#undef RULE_MASK
    }
    return 0;
}

/* The declared transform of slot j: what = 0 decode, 1 encode, 2 divisor. */
ALWAYS_INLINE int declared(int rule, int j, int what) {
    switch (rule) {
#define RULE_SHAPE(ID, NAME, FN, SWITCHES, SLOTS, WRITES, ...) \
    case ID: { const int shape[9] = {__VA_ARGS__}; return shape[3 * j + what]; }
        CKQ_RULES(RULE_SHAPE)
#undef RULE_SHAPE
    }
    return 0;
}

/* Whether a rule declares no transform at all (its fast loop is the generic one). */
ALWAYS_INLINE int declares_none(int rule) {
    return declared(rule, 0, 0) == TR_NONE && declared(rule, 0, 1) == TR_NONE && declared(rule, 1, 0) == TR_NONE &&
           declared(rule, 1, 1) == TR_NONE && declared(rule, 2, 0) == TR_NONE && declared(rule, 2, 1) == TR_NONE;
}

/* ---- The loop of the rule ---- */

/* Lanes i .. i + VL - 1 (``part`` < VL: only the first ``part`` of them, a block's tail) of the slots' rows
 * in[j] through the rule, new values to out[j], p at pf (fp32) updated in place or d written to dout.
 * ``shaped``: in[j] holds stored values and the transforms the rule declares are applied here, else in[j]
 * holds true values (and so does out[j]). acc[j]: the running unsigned max of out[j]'s bits, sign cleared. */
ALWAYS_INLINE void rule_lanes(int rule, int flags, int shaped, const vf *h, const float *hs, vi gsign, vf dec_eps,
                              vf enc_eps, float *const *in, float *const *out, const float *gf, float *pf,
                              float *dout, int i, int part, vi *acc) {
    const int n = rule_slots(rule, flags), full = part == VL;
    vf st[MAX_SLOTS], s[MAX_SLOTS], ns[MAX_SLOTS];
    for (int j = 0; j < n; j++) st[j] = full ? v_load(in[j] + i) : v_load_n(in[j] + i, part);
    for (int j = 0; j < n; j++) {  /* step_torch._decoded: from the stored values */
        const int t = shaped ? declared(rule, j, 0) : TR_NONE;
        s[j] = t == TR_SQRT ? v_mul(st[j], st[j])
             : t == TR_RATIO ? v_mul(st[j], v_add(st[declared(rule, j, 2)], dec_eps)) : st[j];
    }
    vf p = full ? v_load(pf + i) : v_load_n(pf + i, part);
    vf g = full ? v_load(gf + i) : v_load_n(gf + i, part);
    vf d = p;
    g = v_from_bits(vi_xor(v_as_bits(g), gsign));  /* MAXIMIZE: -g */
    apply_rule(rule, h, hs, flags, g, &p, s, &d);
    float *to = rule_writes_d(rule, flags) ? dout : pf;
    vf put = rule_writes_d(rule, flags) ? d : p;
    if (full) v_store(to + i, put); else v_store_n(to + i, put, part);
    for (int j = 0; j < n; j++)  /* step_torch._encoded: square roots first (a ratio's divisor) */
        ns[j] = shaped && declared(rule, j, 1) == TR_SQRT ? v_sqrt(s[j]) : s[j];
    for (int j = 0; j < n; j++)
        if (shaped && declared(rule, j, 1) == TR_RATIO) ns[j] = v_div(s[j], v_add(ns[declared(rule, j, 2)], enc_eps));
    const vm live = vi_ge(vi_set1(part - 1), vi_iota());  /* the lanes of the block */
    for (int j = 0; j < n; j++) {
        if (full) v_store(out[j] + i, ns[j]); else v_store_n(out[j] + i, ns[j], part);
        if (acc) acc[j] = v_absbits_max(acc[j], full ? ns[j] : v_select(live, ns[j], v_set1(0.0f)));
    }
}

/* Elements [0, len) through rule_lanes; mx (NULL: not tracked): the unsigned max of each out[j]'s bits with
 * the sign cleared (bits_to_absmax makes it the new scale). Always inlined with rule, flags and shaped
 * constant: the loop carries no branch on them. */
ALWAYS_INLINE void rule_span(int rule, int flags, int shaped, const vf *h, const float *hs, vi gsign, vf dec_eps,
                             vf enc_eps, float *const *in, float *const *out, const float *gf, float *pf, float *dout,
                             int len, uint32_t *mx) {
    const int n = rule_slots(rule, flags);
    vi acc[MAX_SLOTS];
    for (int j = 0; j < n; j++) acc[j] = vi_set1(0);
    int i = 0;
    for (; i + VL <= len; i += VL)
        rule_lanes(rule, flags, shaped, h, hs, gsign, dec_eps, enc_eps, in, out, gf, pf, dout, i, VL, mx ? acc : 0);
    if (i < len)
        rule_lanes(rule, flags, shaped, h, hs, gsign, dec_eps, enc_eps, in, out, gf, pf, dout, i, len - i,
                   mx ? acc : 0);
    if (mx)
        for (int j = 0; j < n; j++) mx[j] = vi_reduce_max_u(acc[j]);
}

/* ---- The transforms as passes of their own (groups not stored as their rule declares) ---- */

/* x[i] = x[i] * (s[i] + eps) (RATIO decode) or x[i] * x[i] (s NULL: SQRT decode), i < len. */
static void decode_pass(float *x, const float *s, float eps, int len) {
    int i = 0;
    const vf e = v_set1(eps);
    for (; i + VL <= len; i += VL) {
        vf v = v_load(x + i);
        v_store(x + i, s ? v_mul(v, v_add(v_load(s + i), e)) : v_mul(v, v));
    }
    for (; i < len; i++) x[i] = s ? x[i] * (s[i] + eps) : x[i] * x[i];
}

/* x[i] = x[i] / (s[i] + eps) (RATIO encode) or sqrt(x[i]) (s NULL: SQRT encode), i < len. */
static void encode_pass(float *x, const float *s, float eps, int len) {
    int i = 0;
    const vf e = v_set1(eps);
    for (; i + VL <= len; i += VL) {
        vf v = v_load(x + i);
        v_store(x + i, s ? v_div(v, v_add(v_load(s + i), e)) : v_sqrt(v));
    }
    for (; i < len; i++) x[i] = s ? x[i] / (s[i] + eps) : sqrtf(x[i]);
}

/* step_torch._decoded on the rows S[j] (stored -> true): every ratio from its divisor's stored value first,
 * then the squares (accepts_step: a ratio's divisor is not a ratio itself). */
static void decode_transforms(const step_config_t *c, float *const *S, int len, const float *hs) {
    for (int j = 0; j < c->slots; j++)
        if (c->slot[j].decode_as == TR_RATIO) decode_pass(S[j], S[c->slot[j].divisor], hs[c->dec_eps], len);
    for (int j = 0; j < c->slots; j++)
        if (c->slot[j].decode_as == TR_SQRT) decode_pass(S[j], 0, 0.0f, len);
}

/* step_torch._encoded on the rows S[j] (true -> stored): the square roots, then the ratios over their
 * divisors' new stored values; mx[j] as rule_span gives it. */
static void encode_transforms(const step_config_t *c, float *const *S, int len, const float *hs, uint32_t *mx) {
    for (int j = 0; j < c->slots; j++)
        if (c->slot[j].encode_as == TR_SQRT) encode_pass(S[j], 0, 0.0f, len);
    for (int j = 0; j < c->slots; j++)
        if (c->slot[j].encode_as == TR_RATIO) encode_pass(S[j], S[c->slot[j].divisor], hs[c->enc_eps], len);
    for (int j = 0; j < c->slots; j++) mx[j] = absbits_max(S[j], len);
}

/* ---- Decoding and encoding a slot's block: one loop per code width ---- */

static void decode_slot(const vdecode_t *d, const uint8_t *codes, int len, int bits, float scale, float *out) {
    switch (bits) {  /* decode_block inlined with each width constant */
    case 8: decode_block(d, codes, len, 8, scale, 0, out); break;
    case 6: decode_block(d, codes, len, 6, scale, 0, out); break;
    case 4: decode_block(d, codes, len, 4, scale, 0, out); break;
    default: decode_block(d, codes, len, 2, scale, 0, out);
    }
}

/* The block's codes to nearest (h NULL) or stochastically with the uniforms of hashes h (their high halves
 * when ``high``), on the encoder e (prepared with the codebook for stochastic rounding). */
static void encode_slot(const vencode_t *e, const float *x, int len, float absmax, uint8_t *codes, int bits,
                        const uint32_t *h, int high) {
    switch (bits) {  /* encode_prepared inlined with each width constant */
    case 8: encode_prepared(e, x, len, absmax, codes, 8, h, high); break;
    case 6: encode_prepared(e, x, len, absmax, codes, 6, h, high); break;
    case 4: encode_prepared(e, x, len, absmax, codes, 4, h, high); break;
    default: encode_prepared(e, x, len, absmax, codes, 2, h, high);
    }
}

/* ---- The low-bit step ---- */

/* What a thread derives from the config once per call: each slot's prepared decoder, its encoders to
 * nearest and (seeded slots) stochastic, and whether the group is stored as its rule declares. */
typedef struct {
    const step_config_t *c;
    vdecode_t dec[MAX_SLOTS];
    vencode_t nearest[MAX_SLOTS], stochastic[MAX_SLOTS];
    int shaped;
} step_ctx_t;

static void step_ctx_init(step_ctx_t *x, const step_config_t *c) {
    x->c = c;
    x->shaped = 1;
    for (int j = 0; j < c->slots; j++) {
        const slot_config_t *s = c->slot + j;
        const float *thr = s->bits <= 4 ? s->thresholds : 0;
        vdecode_init(&x->dec[j], s->decode, s->bits);
        vencode_init(&x->nearest[j], s->table + 32768, thr, 0, s->bits);
        vencode_init(&x->stochastic[j], s->table + 32768, thr, s->encode, s->bits);
        x->shaped &= s->decode_as == declared(c->rule, j, 0) && s->encode_as == declared(c->rule, j, 1) &&
                     s->divisor == declared(c->rule, j, 2);
    }
}

/* The step's scratch ring: each block's decoded and new values go to the next place in a ring of
 * SCRATCH_RING floats per slot, not to one fixed place. Written at one place block after block, that
 * scratch can stall the loads in flight whose low 12 address bits match it (the param, the grad,
 * constants spilled to the stack: Intel cores check a load against earlier stores by those bits first,
 * "4K aliasing"): the 6+2-bit Adam step at 4M elements took 5.2 to 6.8 cycles per element depending on
 * where the stack happened to lie, 4.5 to 5.2 with the ring (a 4 KB ring did not help). */
#define SCRATCH_RING 4096  /* floats; a power of two */

/* Blocks [b0, b1) of member i by one rule and flag word (always inlined with rule, flags and shaped
 * constant; step_rule_<id> instantiates it). ``shaped``: the loop applies the transforms the rule declares
 * (the group is stored that way, or the rule declares none); a group stored otherwise takes the transform
 * passes around it. Operation order as step_torch.step_tile. */
ALWAYS_INLINE void step_blocks(const step_ctx_t *x, const step_call_t *a, int64_t i, int64_t b0, int64_t b1, int rule,
                               int flags, int shaped) {
    const step_config_t *c = x->c;
    const member_t *mem = (const member_t *)a->members + i;
    const int n = rule_slots(rule, flags), writes_d = rule_writes_d(rule, flags), block = c->block;
    const float *hs = a->hyper + (int64_t)c->fields * i;
    const void *g = (const void *)(uintptr_t)a->grads[i];
    float *out = writes_d ? (float *)(uintptr_t)a->outs[i] : 0;
    const int64_t *seed = a->seeds ? a->seeds + i : 0;
    vf h[MAX_FIELDS];
    for (int k = 0; k < c->fields; k++) h[k] = v_set1(hs[k]);
    const vf dec_eps = v_set1(c->dec_eps >= 0 ? hs[c->dec_eps] : 0.0f);
    const vf enc_eps = v_set1(c->enc_eps >= 0 ? hs[c->enc_eps] : 0.0f);
    const vi gsign = vi_set1(c->flags & MAXIMIZE ? INT32_MIN : 0);
    /* C99 VLAs: a block each of param, grad, hashes (and slot 2's), a ring per slot: 74 KB at the default
     * block size, 176 KB at 4096 */
    float pb[block], gb[block], ring[MAX_SLOTS][SCRATCH_RING + block];
    uint32_t hb[block], hb2[block];
    int at_ring = 0;
    rows_t at = rows_at(mem->row_len, block, b0);
    for (int64_t b = b0; b < b1; b++, rows_next(&at)) {
        const int64_t off = rows_offset(&at);
        const int len = rows_len(&at);
        float *pf = c->pdtype == F32 ? (float *)mem->p + off : pb;  /* fp32 in place, else buffered */
        const float *gf = c->gdtype == F32 ? (const float *)g + off : gb;
        if (c->pdtype != F32) load_block(mem->p, off, len, c->pdtype, 0, pb);
        if (c->gdtype != F32) load_block(g, off, len, c->gdtype, 0, gb);
        at_ring = (at_ring + block) & (SCRATCH_RING - 1);
        float *const S[MAX_SLOTS] = {ring[0] + at_ring, ring[1] + at_ring, ring[2] + at_ring};
        uint8_t *codes[MAX_SLOTS];
        for (int j = 0; j < n; j++) {
            codes[j] = mem->codes[j] + rows_code_byte(&at, c->slot[j].bits);
            decode_slot(&x->dec[j], codes[j], len, c->slot[j].bits, mem->absmax[j][b], S[j]);
        }
        if (!x->shaped) decode_transforms(c, S, len, hs);
        uint32_t mx[MAX_SLOTS];
        rule_span(rule, flags, shaped, h, hs, gsign, dec_eps, enc_eps, S, S, gf, pf, writes_d ? out + off : 0, len,
                  shaped ? mx : 0);
        if (!x->shaped) encode_transforms(c, S, len, hs, mx);
        if (!writes_d && c->pdtype != F32) store_block(mem->p, off, len, c->pdtype, pb);
        float scale[MAX_SLOTS];
        for (int j = 0; j < n; j++) mem->absmax[j][b] = scale[j] = bits_to_absmax(mx[j]);
        int draws = 0;  /* which slots round stochastically */
        for (int j = 0; j < n; j++) draws |= (seed && c->slot[j].seeded) << j;
        if (draws) hashes(hb, len, off, (uint32_t)*seed);  /* off: the element's index in the parameter */
        if (draws & 4) {  /* slot 2's uniforms: the high half of mix32(h) */
            int k = 0;
            for (; k + VL <= len; k += VL) vi_store(hb2 + k, v_mix32(vi_load(hb + k)));
            for (; k < len; k++) hb2[k] = mix32(hb[k]);
        }
        int j = 0;
        if (n >= 2 && !(draws & 3) && c->slot[0].bits == 8 && c->slot[1].bits == 8) {  /* AdamW8bit's default */
            encode_nearest8_pair(S[0], S[1], len, scale[0], scale[1], c->slot[0].table + 32768,
                                 c->slot[1].table + 32768, codes[0], codes[1]);
            j = 2;
        }
        for (; j < n; j++) {
            if (draws >> j & 1)
                encode_slot(&x->stochastic[j], S[j], len, scale[j], codes[j], c->slot[j].bits, j == 2 ? hb2 : hb,
                            j != 1);
            else
                encode_slot(&x->nearest[j], S[j], len, scale[j], codes[j], c->slot[j].bits, 0, 0);
        }
    }
}

/* One rule's work items, compiled per flag word the rule tells apart (its switches) and per transform
 * shape (as declared, or generic), from the shared counter until none are left. */
#define STEP_RULE(ID, NAME, FN, SWITCHES, ...)                                                                   \
    static __attribute__((noinline)) void step_rule_##ID(const step_ctx_t *x, const step_call_t *a,             \
                                                         const int64_t *items, int64_t n_items, int64_t *next) { \
        const int f = rule_switches(ID, x->c->flags), shaped = x->shaped || declares_none(ID);                   \
        for (;;) {                                                                                               \
            int64_t k = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);                                           \
            if (k >= n_items) return;                                                                            \
            const int64_t *it = items + 3 * k;                                                                   \
            STEP_FLAGS(ID, SWITCHES, f, shaped, it);                                                             \
        }                                                                                                        \
    }
#define STEP_SHAPED(ID, F, shaped, it)                                                                           \
    do {                                                                                                         \
        if (shaped) step_blocks(x, a, it[0], it[1], it[2], ID, F, 1);                                            \
        else step_blocks(x, a, it[0], it[1], it[2], ID, F, declares_none(ID));                                   \
    } while (0)
#define STEP_FLAGS(ID, SWITCHES, f, shaped, it)                                                                  \
    do {                                                                                                         \
        if (SWITCHES >= 2 && f == 6) STEP_SHAPED(ID, 6, shaped, it);                                             \
        else if (SWITCHES >= 2 && f == 4) STEP_SHAPED(ID, 4, shaped, it);                                        \
        else if (SWITCHES >= 1 && f == 2) STEP_SHAPED(ID, 2, shaped, it);                                        \
        else STEP_SHAPED(ID, 0, shaped, it);                                                                     \
    } while (0)
CKQ_RULES(STEP_RULE)
#undef STEP_RULE
#undef STEP_SHAPED

/* -1 for a config the kernels cannot take (ckptq's checks never pass one), else 0. */
static int bad_step_config(const step_config_t *c) {
    if (BAD_BLOCK(c->block) || (unsigned)c->pdtype > F16 || (unsigned)c->gdtype > F16 || c->fields < 0 ||
        c->fields > MAX_FIELDS || c->dec_eps >= c->fields || c->enc_eps >= c->fields)
        return 1;
    int slots = -1;
    switch (c->rule) {
#define RULE_COUNT(ID, ...) case ID: slots = rule_slots(ID, c->flags); break;
        CKQ_RULES(RULE_COUNT)
#undef RULE_COUNT
    }
    if (slots != c->slots || slots < 1 || slots > MAX_SLOTS) return 1;
    for (int j = 0; j < slots; j++) {
        const slot_config_t *s = c->slot + j;
        if (BAD_BITS(s->bits, c->block) || (unsigned)s->decode_as > TR_RATIO || (unsigned)s->encode_as > TR_RATIO)
            return 1;
        if ((s->decode_as == TR_RATIO || s->encode_as == TR_RATIO) &&
            (s->divisor < 0 || s->divisor >= slots || s->divisor == j || c->slot[s->divisor].decode_as == TR_RATIO ||
             (s->decode_as == TR_RATIO && c->dec_eps < 0) || (s->encode_as == TR_RATIO && c->enc_eps < 0)))
            return 1;
    }
    return 0;
}

/* The step of a group of parameters, one call per thread. Member i: members[i] (member_t: slot j's codes
 * and scales at codes[j], absmax[j]), its grad at address grads[i] (config.gdtype), its out at outs[i]
 * (fp32 [n]: the direction, where the rule writes one; else outs may be NULL), its hyper row
 * hyper[fields * i ..], its seed seeds[i] (seeds NULL: every slot to nearest). items[3 k .. 3 k + 2] =
 * (member, first block, end block). Returns -1 for a config the kernels cannot take, else 0. */
int ckq_step_group(const step_config_t *config, const member_t *members, const int64_t *grads, const int64_t *outs,
                   const float *hyper, const int64_t *seeds, const int64_t *items, int64_t n_items, int64_t *next) {
    if (bad_step_config(config)) return -1;
    step_ctx_t x;
    step_ctx_init(&x, config);
    const step_call_t a = {members, grads, outs, hyper, seeds};
    switch (config->rule) {
#define RULE_RUN(ID, ...) case ID: step_rule_##ID(&x, &a, items, n_items, next); break;
        CKQ_RULES(RULE_RUN)
#undef RULE_RUN
    }
    return 0;
}

/* ---- The fp32 (dense) step ---- */

/* What a dense group's members share (backend_native's DenseConfig mirrors it). */
typedef struct {
    int32_t rule, flags, slots, pdtype, gdtype, fields;
} dense_config_t;

/* One member of a dense group: its param and its fp32 states (four 64-bit words). */
typedef struct {
    void *p;                /* [n], updated in place (read only where the rule writes d) */
    float *s[MAX_SLOTS];    /* fp32 [n] per slot, updated in place */
} dense_member_t;

#define DENSE_CHUNK 1024  /* elements per pass: 16-bit params and grads go through fp32 buffers of this size */

/* Elements [e0, e1) of member i by one rule and flag word (always inlined with both constant). */
ALWAYS_INLINE void dense_span(const dense_config_t *c, const step_call_t *a, int64_t i, int64_t e0, int64_t e1, int rule,
                              int flags) {
    const dense_member_t *mem = (const dense_member_t *)a->members + i;
    const int writes_d = rule_writes_d(rule, flags);
    const float *hs = a->hyper + (int64_t)c->fields * i;
    const void *g = (const void *)(uintptr_t)a->grads[i];
    float *out = writes_d ? (float *)(uintptr_t)a->outs[i] : 0;
    vf h[MAX_FIELDS];
    for (int k = 0; k < c->fields; k++) h[k] = v_set1(hs[k]);
    const vi gsign = vi_set1(c->flags & MAXIMIZE ? INT32_MIN : 0);
    float pb[DENSE_CHUNK], gb[DENSE_CHUNK];
    for (int64_t off = e0; off < e1; off += DENSE_CHUNK) {
        const int len = (int)(e1 - off < DENSE_CHUNK ? e1 - off : DENSE_CHUNK);
        float *pf = c->pdtype == F32 ? (float *)mem->p + off : pb;
        const float *gf = c->gdtype == F32 ? (const float *)g + off : gb;
        if (c->pdtype != F32) load_block(mem->p, off, len, c->pdtype, 0, pb);
        if (c->gdtype != F32) load_block(g, off, len, c->gdtype, 0, gb);
        float *const s[MAX_SLOTS] = {mem->s[0] + off, mem->s[1] ? mem->s[1] + off : 0, mem->s[2] ? mem->s[2] + off : 0};
        rule_span(rule, flags, 0, h, hs, gsign, v_set1(0.0f), v_set1(0.0f), s, s, gf, pf, writes_d ? out + off : 0,
                  len, 0);
        if (!writes_d && c->pdtype != F32) store_block(mem->p, off, len, c->pdtype, pb);
    }
}

#define DENSE_RULE(ID, NAME, FN, SWITCHES, ...)                                                                  \
    static __attribute__((noinline)) void dense_rule_##ID(const dense_config_t *c, const step_call_t *a,        \
                                                          const int64_t *items, int64_t n_items, int64_t *next) { \
        const int f = rule_switches(ID, c->flags);                                                               \
        for (;;) {                                                                                               \
            int64_t k = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);                                           \
            if (k >= n_items) return;                                                                            \
            const int64_t *it = items + 3 * k;                                                                   \
            if (SWITCHES >= 2 && f == 6) dense_span(c, a, it[0], it[1], it[2], ID, 6);                           \
            else if (SWITCHES >= 2 && f == 4) dense_span(c, a, it[0], it[1], it[2], ID, 4);                      \
            else if (SWITCHES >= 1 && f == 2) dense_span(c, a, it[0], it[1], it[2], ID, 2);                      \
            else dense_span(c, a, it[0], it[1], it[2], ID, 0);                                                   \
        }                                                                                                        \
    }
CKQ_RULES(DENSE_RULE)
#undef DENSE_RULE
#undef STEP_FLAGS

/* The rule on plain fp32 states (step_torch.dense_group of each member), one call per thread sharing
 * ``next``; members[i]: dense_member_t; items[3 k ..] = (member, first element, end element). Returns -1
 * for a config the kernels cannot take, else 0. */
int ckq_dense_group(const dense_config_t *config, const dense_member_t *members, const int64_t *grads,
                    const int64_t *outs, const float *hyper, const int64_t *items, int64_t n_items, int64_t *next) {
    int slots = -1;
    switch (config->rule) {
#define RULE_COUNT(ID, ...) case ID: slots = rule_slots(ID, config->flags); break;
        CKQ_RULES(RULE_COUNT)
#undef RULE_COUNT
    }
    if (slots != config->slots || slots < 1 || slots > MAX_SLOTS || (unsigned)config->pdtype > F16 ||
        (unsigned)config->gdtype > F16 || config->fields < 0 || config->fields > MAX_FIELDS)
        return -1;
    const step_call_t a = {members, grads, outs, hyper, 0};
    switch (config->rule) {
#define RULE_RUN(ID, ...) case ID: dense_rule_##ID(config, &a, items, n_items, next); break;
        CKQ_RULES(RULE_RUN)
#undef RULE_RUN
    }
    return 0;
}

/* The kernels' id of the rule named ``name`` (rules.RULES' key), or -1: the rules this build implements. */
int ckq_rule_id(const char *name) {
#define RULE_NAME(ID, NAME, ...) if (!strcmp(name, NAME)) return ID;
    CKQ_RULES(RULE_NAME)
#undef RULE_NAME
    return -1;
}

#endif /* CKQ_STEP_H */
