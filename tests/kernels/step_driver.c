/* The grouped steps of the C kernels (ckq_step_group, ckq_dense_group: kernels/step.h) built for another
 * machine (tests/kernels/test_step_driver.py): compiled with cpu_kernels.c for a target such as aarch64 and run
 * there (or under qemu-user), it reads a script of groups whose arrays the PyTorch reference wrote as raw
 * little-endian files, rebuilds the structs backend_native would pass (step_config_t, member_t,
 * dense_config_t, dense_member_t: addresses are this process's, so nothing of them travels), calls the step
 * on one thread and writes every array the step may change to its input's path + ".got".
 *
 * A low-bit group: one "step" line, then one "slot" line per slot and one "member" line per member:
 *   step   RULE FLAGS SLOTS BLOCK PDTYPE GDTYPE FIELDS DEC_EPS ENC_EPS MEMBERS HYPER SEEDS|- ITEM_BLOCKS
 *   slot   BITS DECODE_AS ENCODE_AS DIVISOR SEEDED DECODE TABLE THRESHOLDS ENCODE
 *   member N ROW_LEN P GRAD OUT|- CODES_0 ABSMAX_0 ... CODES_{SLOTS-1} ABSMAX_{SLOTS-1}
 * (RULE: rules.RULES' key, through ckq_rule_id; ROW_LEN: the row length, n for the flat layout; HYPER fp32
 * [MEMBERS, FIELDS]; SEEDS int64 [MEMBERS] or "-" for nearest; work items of ITEM_BLOCKS blocks, so that
 * items start inside rows.) Writes P, OUT, every CODES and ABSMAX.
 * A group of fp32 states: one "dense" line, then one "dmember" line per member:
 *   dense   RULE FLAGS SLOTS PDTYPE GDTYPE FIELDS MEMBERS HYPER ITEM_ELEMENTS
 *   dmember N P GRAD OUT|- STATE_0 ... STATE_{SLOTS-1}
 * Writes P, OUT and every STATE.
 * The first line of output names the SIMD path compiled in; then "ok" per group. Exit status 1 on error.
 */
#include "cpu_kernels.c"

#include "driver_io.h"

static FILE *script;
static char line[16384];
static char *cursor;

static void fail(const char *what) {
    fprintf(stderr, "%s: %s", what, line);
    exit(1);
}

/* The next line of the script, its first word ``kind`` (NULL at the end). */
static const char *next_line(const char *kind) {
    if (!fgets(line, sizeof line, script)) {
        if (kind) fail("script ends early");
        return 0;
    }
    const char *first = strtok(line, " \t\n");
    if (kind && (!first || strcmp(first, kind))) fail(kind);
    return first;
}

static const char *word(void) {
    const char *w = strtok(0, " \t\n");
    if (!w) fail("line too short");
    return w;
}

static long long number(void) {
    char *end;
    long long v = strtoll(word(), &end, 10);
    if (*end) fail("not a number");
    return v;
}

/* A file's bytes, or NULL for "-". */
static void *maybe_file(const char *path, size_t *size) {
    if (size) *size = 0;
    return strcmp(path, "-") ? read_file(path, size) : 0;
}

static char *path_got(const char *path) {
    char *p = malloc(strlen(path) + 5);
    strcpy(p, path);
    return strcat(p, ".got");
}

/* An array the step changes: its buffer, size and where its output goes. */
typedef struct { void *p; size_t size; char *out; } array_t;

static array_t array(const char *path) {
    array_t a = {0, 0, 0};
    if (strcmp(path, "-")) {
        a.p = read_file(path, &a.size);
        a.out = path_got(path);
    }
    return a;
}

static void put(const array_t *a) {
    if (a->p) write_back(a->out, a->p, a->size);
}

static int rule_of(const char *name) {
    const int id = ckq_rule_id(name);
    if (id < 0) fail("unknown rule");
    return id;
}

/* One item list: (member, first, end) covering count[i] units of each member, ``per`` at a time. */
static int64_t *items_of(const int64_t *count, int members, int64_t per, int64_t *n_items) {
    int64_t n = 0;
    for (int i = 0; i < members; i++) n += (count[i] + per - 1) / per;
    int64_t *items = malloc((size_t)(3 * n + 1) * sizeof *items), k = 0;
    for (int i = 0; i < members; i++)
        for (int64_t s = 0; s < count[i]; s += per, k++) {
            items[3 * k] = i;
            items[3 * k + 1] = s;
            items[3 * k + 2] = s + per < count[i] ? s + per : count[i];
        }
    *n_items = n;
    return items;
}

#define MAX_MEMBERS 16

static void run_step(void) {
    step_config_t c;
    memset(&c, 0, sizeof c);
    c.rule = rule_of(word());
    c.flags = (int32_t)number(), c.slots = (int32_t)number(), c.block = (int32_t)number();
    c.pdtype = (int32_t)number(), c.gdtype = (int32_t)number(), c.fields = (int32_t)number();
    c.dec_eps = (int32_t)number(), c.enc_eps = (int32_t)number();
    const int members = (int)number();
    const float *hyper = read_file(word(), 0);
    const int64_t *seeds = maybe_file(word(), 0);
    const int64_t per_item = number();
    if (members < 1 || members > MAX_MEMBERS || c.slots < 1 || c.slots > MAX_SLOTS) fail("bad group");
    for (int j = 0; j < c.slots; j++) {
        slot_config_t *s = c.slot + j;
        next_line("slot");
        s->bits = (int32_t)number(), s->decode_as = (int32_t)number(), s->encode_as = (int32_t)number();
        s->divisor = (int32_t)number(), s->seeded = (int32_t)number();
        s->decode = read_file(word(), 0), s->table = read_file(word(), 0), s->floor_table = 0;
        s->thresholds = read_file(word(), 0), s->encode = read_file(word(), 0);
    }
    member_t mem[MAX_MEMBERS];
    array_t p[MAX_MEMBERS], out[MAX_MEMBERS], codes[MAX_MEMBERS][MAX_SLOTS], absmax[MAX_MEMBERS][MAX_SLOTS];
    int64_t grads[MAX_MEMBERS], outs[MAX_MEMBERS], blocks[MAX_MEMBERS];
    memset(mem, 0, sizeof mem);
    for (int i = 0; i < members; i++) {
        next_line("member");
        number();  /* n: the files' sizes carry it */
        mem[i].row_len = number();
        p[i] = array(word());
        grads[i] = (int64_t)(uintptr_t)read_file(word(), 0);
        out[i] = array(word());
        outs[i] = (int64_t)(uintptr_t)out[i].p;
        mem[i].p = p[i].p;
        for (int j = 0; j < c.slots; j++) {
            codes[i][j] = array(word());
            absmax[i][j] = array(word());
            mem[i].codes[j] = codes[i][j].p;
            mem[i].absmax[j] = absmax[i][j].p;
        }
        blocks[i] = (int64_t)(absmax[i][0].size / 4);
    }
    int64_t n_items, next = 0;
    int64_t *items = items_of(blocks, members, per_item, &n_items);
    if (ckq_step_group(&c, mem, grads, outs, hyper, seeds, items, n_items, &next)) fail("ckq_step_group refused");
    for (int i = 0; i < members; i++) {
        put(&p[i]), put(&out[i]);
        for (int j = 0; j < c.slots; j++) put(&codes[i][j]), put(&absmax[i][j]);
    }
}

static void run_dense(void) {
    dense_config_t c;
    c.rule = rule_of(word());
    c.flags = (int32_t)number(), c.slots = (int32_t)number(), c.pdtype = (int32_t)number();
    c.gdtype = (int32_t)number(), c.fields = (int32_t)number();
    const int members = (int)number();
    const float *hyper = read_file(word(), 0);
    const int64_t per_item = number();
    if (members < 1 || members > MAX_MEMBERS || c.slots < 1 || c.slots > MAX_SLOTS) fail("bad group");
    dense_member_t mem[MAX_MEMBERS];
    array_t p[MAX_MEMBERS], out[MAX_MEMBERS], states[MAX_MEMBERS][MAX_SLOTS];
    int64_t grads[MAX_MEMBERS], outs[MAX_MEMBERS], sizes[MAX_MEMBERS];
    memset(mem, 0, sizeof mem);
    for (int i = 0; i < members; i++) {
        next_line("dmember");
        sizes[i] = number();
        p[i] = array(word());
        grads[i] = (int64_t)(uintptr_t)read_file(word(), 0);
        out[i] = array(word());
        outs[i] = (int64_t)(uintptr_t)out[i].p;
        mem[i].p = p[i].p;
        for (int j = 0; j < c.slots; j++) {
            states[i][j] = array(word());
            mem[i].s[j] = states[i][j].p;
        }
    }
    int64_t n_items, next = 0;
    int64_t *items = items_of(sizes, members, per_item, &n_items);
    if (ckq_dense_group(&c, mem, grads, outs, hyper, items, n_items, &next)) fail("ckq_dense_group refused");
    for (int i = 0; i < members; i++) {
        put(&p[i]), put(&out[i]);
        for (int j = 0; j < c.slots; j++) put(&states[i][j]);
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SCRIPT\n", argv[0]);
        return 2;
    }
    printf("isa %s\n", SIMD_ISA);
    script = fopen(argv[1], "r");
    if (!script) return fprintf(stderr, "cannot open %s\n", argv[1]), 1;
    for (const char *kind; (kind = next_line(0));) {
        if (!strcmp(kind, "step")) run_step();
        else if (!strcmp(kind, "dense")) run_dense();
        else fail("unknown group");
        printf("ok\n");
    }
    return 0;
}
