/* The optimizers' elementwise rules in C: each rule of ckptq.kernels.rules written once, op for op, as a
 * small function over the SIMD layer's vector type vf (simd.h). The same function is the AVX-512, AVX2,
 * NEON and scalar code (VL lanes of whatever the build targets; a block's last len % VL elements go through
 * it as a partial vector), and serves the low-bit step and the fp32 (dense) step alike: step.h's skeleton
 * decodes, calls the rule, encodes.
 *
 * A rule sees true values, never codes (rules.py's docstring):
 *   h      the member's scalars, rules.Rule.fields[k] broadcast to every lane of h[k]
 *   hs     the same scalars as floats (a switch on a scalar, as RAdam's rectify)
 *   flags  rules.MAXIMIZE | the rule's switches (Rule.flags: bits 1, 2); a constant where it is inlined,
 *          so every switch compiles away; MAXIMIZE is already applied (g is negated)
 *   g      the gradient, fp32
 *   p      in: the parameter, fp32; out: the new parameter (not read back where the rule writes d)
 *   s      in: the states' true values in slot order (Rule.states(flags)); out: their new true values
 *   d      out: the direction, for the rules that write one (rules.writes_direction); else untouched
 * Arithmetic: each v_add, v_sub, v_mul, v_div, v_sqrt one IEEE fp32 operation, in the order rules.py
 * writes it (products of torch's `a * b` kept as written: IEEE multiplication commutes, so a fold into
 * another order would not change bits, but no reassociation of sums, and no FMA).
 *
 * Adding a rule (say rules.FOO): its function here, its slot count per flag word (foo_slots), and a line in
 * CKQ_RULES below; the C backend then takes its groups (backend_native asks ckq_rule_id). The line's last
 * three entries are the transforms the optimizer declares for its slots (spec.State.transform: T_NONE,
 * T_SQRT, T_RATIO(k) relative to slot k), in slot order: groups stored that way (every group once its first
 * step has rewritten an older file's states) run with the transforms inlined in the rule's loop; others
 * take the generic transform passes (step.h).
 */
#ifndef CKQ_STEP_RULES_H
#define CKQ_STEP_RULES_H

#define RULE_FN static inline __attribute__((always_inline)) void

/* rules.MAXIMIZE and each rule's switches (rules.Rule.flag). */
enum { MAXIMIZE = 1 };
enum { ADAM_AMSGRAD = 2 };
enum { MOMENTUM_LINEAR = 2, MOMENTUM_SIGN = 4 };
enum { RMSPROP_HEAVY = 2, RMSPROP_CENTERED = 4 };

/* torch.maximum: NaN where either is. */
static inline __attribute__((always_inline)) vf v_maximum(vf a, vf b) {
    vf r = v_select(v_lt(a, b), b, a);
    return v_select(v_isnan(a), a, v_select(v_isnan(b), b, r));
}

/* torch.where(isnan(d), d, sign(d)): -1, +0 or 1 (torch.sign(-0.0) is +0.0), NaN kept. */
static inline __attribute__((always_inline)) vf v_sign_or_nan(vf d) {
    const vf zero = v_set1(0.0f);
    vf s = v_select(v_lt(zero, d), v_set1(1.0f), v_select(v_lt(d, zero), v_set1(-1.0f), zero));
    return v_select(v_isnan(d), d, s);
}

/* rules._adam_moments: gi = g + l2 * p; m += omb1 * (gi - m); v = v * beta2 + omb2 * gi^2. Returns gi. */
static inline __attribute__((always_inline)) vf adam_moments(const vf *h, vf p, vf g, vf *m, vf *v) {
    vf gi = v_add(g, v_mul(h[1], p));
    *m = v_add(*m, v_mul(h[2], v_sub(gi, *m)));
    *v = v_add(v_mul(*v, h[3]), v_mul(h[4], v_mul(gi, gi)));
    return gi;
}

/* sqrt(v) / bc2_sqrt + eps (fields 7 and 5 of Adam's scalars and AdEMAMix's). */
static inline __attribute__((always_inline)) vf adam_denominator(const vf *h, vf v) {
    return v_add(v_div(v_sqrt(v), h[7]), h[5]);
}

/* rules.adam: slots m, v[, vmax]. */
RULE_FN rule_adam(const vf *h, const float *hs, int flags, vf g, vf *p, vf *s, vf *d) {
    (void)hs, (void)d;
    adam_moments(h, *p, g, &s[0], &s[1]);
    vf top = s[1];
    if (flags & ADAM_AMSGRAD) top = s[2] = v_maximum(s[2], s[1]);
    *p = v_add(v_mul(*p, h[0]), v_mul(h[6], v_div(s[0], adam_denominator(h, top))));
}
static inline int adam_slots(int flags) { return flags & ADAM_AMSGRAD ? 3 : 2; }

/* rules.nadam: p = (p * decay + neg_grad_step * (gi / denom)) + neg_step * (m / denom). */
RULE_FN rule_nadam(const vf *h, const float *hs, int flags, vf g, vf *p, vf *s, vf *d) {
    (void)hs, (void)flags, (void)d;
    vf gi = adam_moments(h, *p, g, &s[0], &s[1]);
    vf denom = adam_denominator(h, s[1]);
    *p = v_add(v_add(v_mul(*p, h[0]), v_mul(h[10], v_div(gi, denom))), v_mul(h[6], v_div(s[0], denom)));
}

/* rules.radam: m / denom where the variance is tractable (rectify, field 10, nonzero), else m. */
RULE_FN rule_radam(const vf *h, const float *hs, int flags, vf g, vf *p, vf *s, vf *d) {
    (void)flags, (void)d;
    adam_moments(h, *p, g, &s[0], &s[1]);
    vf step = hs[10] != 0.0f ? v_div(s[0], adam_denominator(h, s[1])) : s[0];
    *p = v_add(v_mul(*p, h[0]), v_mul(h[6], step));
}
static inline int two_slots(int flags) { (void)flags; return 2; }

/* rules.ademamix: slots m1, m2, nu. */
RULE_FN rule_ademamix(const vf *h, const float *hs, int flags, vf g, vf *p, vf *s, vf *d) {
    (void)hs, (void)flags, (void)d;
    s[0] = v_add(s[0], v_mul(h[1], v_sub(g, s[0])));
    s[1] = v_add(s[1], v_mul(h[2], v_sub(g, s[1])));
    s[2] = v_add(v_mul(s[2], h[3]), v_mul(h[4], v_mul(g, g)));
    vf mix = v_add(v_div(s[0], h[8]), v_mul(h[9], s[1]));
    *p = v_add(v_mul(*p, h[0]), v_mul(h[6], v_div(mix, adam_denominator(h, s[2]))));
}
static inline int three_slots(int flags) { (void)flags; return 3; }

/* rules.momentum (SGD, Lion, Muon): LINEAR applies d, SIGN its sign, neither writes d. */
RULE_FN rule_momentum(const vf *h, const float *hs, int flags, vf g, vf *p, vf *s, vf *d) {
    (void)hs;
    vf m = s[0];
    vf gi = v_add(g, v_mul(h[0], *p));
    s[0] = v_add(v_mul(m, h[1]), v_mul(h[2], gi));
    *d = v_add(v_add(v_mul(m, h[3]), v_mul(s[0], h[4])), v_mul(gi, h[5]));
    if (flags & MOMENTUM_LINEAR)
        *p = v_add(v_mul(*p, h[6]), v_mul(h[7], *d));
    else if (flags & MOMENTUM_SIGN)
        *p = v_add(v_mul(*p, h[6]), v_mul(h[7], v_sign_or_nan(*d)));
}
static inline int one_slot(int flags) { (void)flags; return 1; }
static inline int momentum_writes_d(int flags) { return !(flags & (MOMENTUM_LINEAR | MOMENTUM_SIGN)); }

/* rules.rmsprop: slots v[, buf (HEAVY)][, grad_avg (CENTERED)]; a negative v - grad_avg^2 taken as 0. */
RULE_FN rule_rmsprop(const vf *h, const float *hs, int flags, vf g, vf *p, vf *s, vf *d) {
    (void)hs, (void)d;
    const int heavy = flags & RMSPROP_HEAVY, ga = heavy ? 2 : 1;
    vf gi = v_add(g, v_mul(h[0], *p));
    s[0] = v_add(v_mul(s[0], h[1]), v_mul(h[2], v_mul(gi, gi)));
    vf avg;
    if (flags & RMSPROP_CENTERED) {
        s[ga] = v_add(s[ga], v_mul(h[2], v_sub(gi, s[ga])));
        vf var = v_sub(s[0], v_mul(s[ga], s[ga]));
        avg = v_add(v_sqrt(v_select(v_lt(var, v_set1(0.0f)), v_set1(0.0f), var)), h[3]);
    } else {
        avg = v_add(v_sqrt(s[0]), h[3]);
    }
    if (heavy) {
        s[1] = v_add(v_mul(s[1], h[5]), v_div(gi, avg));
        *p = v_add(*p, v_mul(h[4], s[1]));
    } else {
        *p = v_add(*p, v_mul(h[4], v_div(gi, avg)));
    }
}
static inline int rmsprop_slots(int flags) { return 1 + !!(flags & RMSPROP_HEAVY) + !!(flags & RMSPROP_CENTERED); }

/* rules.adagrad: slot sum. */
RULE_FN rule_adagrad(const vf *h, const float *hs, int flags, vf g, vf *p, vf *s, vf *d) {
    (void)hs, (void)flags, (void)d;
    vf gi = v_add(g, v_mul(h[0], *p));
    s[0] = v_add(s[0], v_mul(gi, gi));
    *p = v_add(*p, v_mul(h[1], v_div(gi, v_add(v_sqrt(s[0]), h[2]))));
}

static inline int never_writes_d(int flags) { (void)flags; return 0; }

/* Slot transforms (contract.NONE, SQRT, RATIO; a ratio relative to slot k), as (decode, encode, divisor). */
#define T_NONE 0, 0, -1
#define T_SQRT 1, 1, -1
#define T_RATIO(k) 2, 2, (k)

/* The rules (rules.RULES: its name, the function, its switch count, slots per flag word, whether a flag
 * word writes d instead of p, the declared transforms of slots 0, 1, 2). X(ID, ...) for each; ID is the
 * kernels' number for it (ckq_rule_id). */
#define CKQ_RULES(X)                                                                                       \
    X(0, "adam", rule_adam, 1, adam_slots, never_writes_d, T_RATIO(1), T_SQRT, T_SQRT)                      \
    X(1, "nadam", rule_nadam, 0, two_slots, never_writes_d, T_RATIO(1), T_SQRT, T_NONE)                     \
    X(2, "radam", rule_radam, 0, two_slots, never_writes_d, T_RATIO(1), T_SQRT, T_NONE)                     \
    X(3, "ademamix", rule_ademamix, 0, three_slots, never_writes_d, T_NONE, T_NONE, T_SQRT)                 \
    X(4, "momentum", rule_momentum, 2, one_slot, momentum_writes_d, T_NONE, T_NONE, T_NONE)                 \
    X(5, "rmsprop", rule_rmsprop, 2, rmsprop_slots, never_writes_d, T_SQRT, T_NONE, T_NONE)                 \
    X(6, "adagrad", rule_adagrad, 0, one_slot, never_writes_d, T_SQRT, T_NONE, T_NONE)

#endif /* CKQ_STEP_RULES_H */
