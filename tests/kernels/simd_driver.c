/* A test driver for the C kernels built for another machine (tests/kernels/test_simd_driver.py): compiled with
 * cpu_kernels.c (included, so the SIMD layer's static blocks are reachable) for a target such as aarch64,
 * run there (or under qemu-user), it reads a script of operations on raw little-endian files that the
 * PyTorch reference wrote, and writes each operation's output to a file the test compares bit for bit.
 *
 * Script lines (sizes follow from n, row_len, block and bits as in ckptq.kernels.contract's row layout):
 *   quantize   SRC DTYPE N ROW_LEN BLOCK SQRT BITS TABLE THR|- CODES ABSMAX
 *   dequantize CODES ABSMAX QMAP N ROW_LEN BLOCK SQRT BITS OUT
 *   stochastic X N ROW_LEN BLOCK BITS TABLE THR|- Q SEED HIGH CODES ABSMAX
 *     (X fp32; per block: absmax, the hashes of its elements' indices with SEED, encode_block rounding
 *     stochastically on the codebook Q with the hashes' high (HIGH 1) or low halves, as the steps do)
 *   load       SRC DTYPE N OUT      (load_block: to fp32)
 *   store      SRC N DTYPE OUT      (store_block: fp32 to a 16-bit DTYPE)
 *   partial    SRC N OUT            (fp32 copied VL at a time, the last len % VL through v_load_n and
 *                                    v_store_n; OUT holds N + 16 floats, the 16 past N as they were)
 * The first line of output names the SIMD path compiled in; then "ok" per line. Exit status 1 on error.
 */
#define CKQ_CODEC_ONLY  /* the codec, without the steps (much faster to compile) */
#include "cpu_kernels.c"

#include "driver_io.h"

typedef struct { int64_t rows, row_len, per_row, blocks, row_bytes; } layout_t;

static layout_t layout(int64_t n, int64_t row_len, int64_t block, int bits) {
    layout_t l;
    l.row_len = row_len;
    l.rows = n / row_len;
    l.per_row = (row_len + block - 1) / block;
    l.blocks = l.rows * l.per_row;
    l.row_bytes = (row_len * bits + 7) / 8;
    return l;
}

static int check(int rc, const char *what) {
    if (rc != 0) {
        fprintf(stderr, "%s returned %d\n", what, rc);
        exit(1);
    }
    return rc;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SCRIPT\n", argv[0]);
        return 2;
    }
    printf("isa %s\n", SIMD_ISA);
    FILE *script = fopen(argv[1], "r");
    if (!script) return 1;
    char line[8192], op[32];
    while (fgets(line, sizeof line, script)) {
        char a[12][1024];
        long long n, row_len, block, sqrt_t, bits, dtype, seed, high;
        if (sscanf(line, "%31s", op) != 1) continue;
        if (!strcmp(op, "quantize")) {
            if (sscanf(line, "%*s %1023s %lld %lld %lld %lld %lld %lld %1023s %1023s %1023s %1023s", a[0], &dtype, &n,
                       &row_len, &block, &sqrt_t, &bits, a[1], a[2], a[3], a[4]) != 11)
                return fprintf(stderr, "bad line: %s", line), 1;
            layout_t l = layout(n, row_len, block, (int)bits);
            void *src = read_file(a[0], 0);
            int32_t *table = read_file(a[1], 0);
            float *thr = strcmp(a[2], "-") ? read_file(a[2], 0) : 0;
            uint8_t *codes = filled((size_t)(l.rows * l.row_bytes));
            float *absmax = filled((size_t)l.blocks * 4);
            check(ckq_quantize(src, (int)dtype, row_len, block, 0, l.blocks, (int)sqrt_t, table, codes, absmax,
                               (int)bits, thr), "ckq_quantize");
            write_back(a[3], codes, (size_t)(l.rows * l.row_bytes));
            write_back(a[4], absmax, (size_t)l.blocks * 4);
        } else if (!strcmp(op, "dequantize")) {
            if (sscanf(line, "%*s %1023s %1023s %1023s %lld %lld %lld %lld %lld %1023s", a[0], a[1], a[2], &n, &row_len,
                       &block, &sqrt_t, &bits, a[3]) != 9)
                return fprintf(stderr, "bad line: %s", line), 1;
            layout_t l = layout(n, row_len, block, (int)bits);
            float *out = filled((size_t)n * 4);
            check(ckq_dequantize(read_file(a[0], 0), read_file(a[1], 0), read_file(a[2], 0), row_len, block, 0,
                                 l.blocks, (int)sqrt_t, out, 0, (int)bits), "ckq_dequantize");
            write_back(a[3], out, (size_t)n * 4);
        } else if (!strcmp(op, "stochastic")) {
            if (sscanf(line, "%*s %1023s %lld %lld %lld %lld %1023s %1023s %1023s %lld %lld %1023s %1023s", a[0], &n,
                       &row_len, &block, &bits, a[1], a[2], a[3], &seed, &high, a[4], a[5]) != 12)
                return fprintf(stderr, "bad line: %s", line), 1;
            layout_t l = layout(n, row_len, block, (int)bits);
            const float *x = read_file(a[0], 0);
            const int32_t *table = (const int32_t *)read_file(a[1], 0) + 32768;
            const float *thr = strcmp(a[2], "-") ? read_file(a[2], 0) : 0;
            const float *q = read_file(a[3], 0);
            uint8_t *codes = filled((size_t)(l.rows * l.row_bytes));
            float *absmax = filled((size_t)l.blocks * 4);
            uint32_t h[MAX_BLOCK];
            rows_t at = rows_at(row_len, block, 0);
            for (int64_t b = 0; b < l.blocks; b++, rows_next(&at)) {
                const int64_t off = rows_offset(&at);
                const int len = rows_len(&at);
                absmax[b] = block_absmax(x + off, len);
                hashes(h, len, off, (uint32_t)seed);
                encode_block(x + off, len, absmax[b], table, codes + rows_code_byte(&at, (int)bits), (int)bits, q, h,
                             (int)high, thr);
            }
            write_back(a[4], codes, (size_t)(l.rows * l.row_bytes));
            write_back(a[5], absmax, (size_t)l.blocks * 4);
        } else if (!strcmp(op, "load")) {
            if (sscanf(line, "%*s %1023s %lld %lld %1023s", a[0], &dtype, &n, a[1]) != 4)
                return fprintf(stderr, "bad line: %s", line), 1;
            float *out = filled((size_t)n * 4);
            load_block(read_file(a[0], 0), 0, (int)n, (int)dtype, 0, out);
            write_back(a[1], out, (size_t)n * 4);
        } else if (!strcmp(op, "store")) {
            if (sscanf(line, "%*s %1023s %lld %lld %1023s", a[0], &n, &dtype, a[1]) != 4)
                return fprintf(stderr, "bad line: %s", line), 1;
            uint16_t *out = filled((size_t)n * 2);
            store_block(out, 0, (int)n, (int)dtype, read_file(a[0], 0));
            write_back(a[1], out, (size_t)n * 2);
        } else if (!strcmp(op, "partial")) {
            if (sscanf(line, "%*s %1023s %lld %1023s", a[0], &n, a[1]) != 3)
                return fprintf(stderr, "bad line: %s", line), 1;
            const float *src = read_file(a[0], 0);
            float *out = filled((size_t)(n + 16) * 4), lanes[VL];
            for (int i = 0; i < n; i += VL) {
                const int k = n - i < VL ? (int)(n - i) : VL;
                if (k == VL) {
                    v_store(out + i, v_load(src + i));
                    continue;
                }
                vf v = v_load_n(src + i, k);
                v_store_n(out + i, v, k);
                v_store(lanes, v);
                for (int j = k; j < VL; j++)
                    if (f2u(lanes[j]) != 0) return fprintf(stderr, "v_load_n(%d) left lane %d nonzero\n", k, j), 1;
            }
            write_back(a[1], out, (size_t)(n + 16) * 4);
        } else {
            return fprintf(stderr, "unknown operation: %s", line), 1;
        }
        printf("ok\n");
    }
    return 0;
}
