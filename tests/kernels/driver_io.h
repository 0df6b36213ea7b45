/* File helpers of the test drivers (tests/kernels/simd_driver.c, tests/kernels/step_driver.c): raw little-endian arrays that
 * the tests write and read back. Every buffer has GUARD bytes of 0xA5 past its end, so that a kernel writing
 * past an array shows up (write_back refuses the buffer) rather than passing unseen. */
#ifndef CKQ_DRIVER_IO_H
#define CKQ_DRIVER_IO_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GUARD 64

/* n bytes of 0xA5 and the guard after them. */
static void *filled(size_t n) {
    unsigned char *p = malloc(n + GUARD);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    memset(p, 0xA5, n + GUARD);
    return p;
}

/* The file's bytes in a guarded buffer; its size to *size (when size is not NULL). */
static void *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path);
        exit(1);
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *p = filled((size_t)n);
    if (fread(p, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "cannot read %s\n", path);
        exit(1);
    }
    fclose(f);
    if (size) *size = (size_t)n;
    return p;
}

static void write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(1);
    }
    fclose(f);
}

/* write_file of a buffer from filled / read_file, after checking that its guard is intact. */
static void write_back(const char *path, const void *p, size_t n) {
    const unsigned char *g = (const unsigned char *)p + n;
    for (int k = 0; k < GUARD; k++)
        if (g[k] != 0xA5) {
            fprintf(stderr, "written past the end of %s (byte %zu)\n", path, n + (size_t)k);
            exit(1);
        }
    write_file(path, p, n);
}

#endif /* CKQ_DRIVER_IO_H */
