/* A stand-in for the real driver in test.sh: a few driver names with different signatures,
 * each returning a checksum of its arguments, and a cuGetProcAddress_v2 that also hands out a
 * function no exported name has. Not a driver: nothing here talks to a GPU. */
#include <stdint.h>
#include <string.h>

#define MIX(h, x) ((h) = ((h) ^ (uint64_t)(x)) * 0x100000001b3ull)

int fake_cuInit_calls;

int cuInit(unsigned flags) {
    fake_cuInit_calls++;
    return (int)(flags * 7u + 3u);
}

int cuEventRecord(void *event, void *stream) {
    uint64_t h = 1469598103934665603ull;
    MIX(h, event);
    MIX(h, stream);
    return (int)(h & 0x7fffffff);
}

/* 11 arguments: the last five are on the stack. */
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shmem, void *stream, void **params, void **extra) {
    uint64_t h = 1469598103934665603ull;
    MIX(h, f); MIX(h, gx); MIX(h, gy); MIX(h, gz); MIX(h, bx); MIX(h, by); MIX(h, bz);
    MIX(h, shmem); MIX(h, stream); MIX(h, params); MIX(h, extra);
    if (params)
        *(uint64_t *)params[0] = h; /* an output through a stack argument */
    return (int)(h & 0x7fffffff);
}

/* A 64-bit result through an out pointer, 64-bit arguments in registers. */
int cuMemAlloc_v2(uint64_t *dptr, size_t bytes) {
    *dptr = 0xdead000000000000ull | bytes;
    return bytes == 0 ? 1 : 0;
}

/* Reached only through cuGetProcAddress_v2 ("cuHidden"): a spare trampoline's job. */
static int hidden(int a, int b, int c, int d, int e, int f, int g, int h8) {
    return a + 2 * b + 3 * c + 4 * d + 5 * e + 6 * f + 7 * g + 8 * h8;
}

int cuGetProcAddress_v2(const char *sym, void **pfn, int version, uint64_t flags, int *status) {
    (void)version;
    (void)flags;
    void *p = 0;
    if (!strcmp(sym, "cuInit")) p = (void *)cuInit;
    else if (!strcmp(sym, "cuLaunchKernel")) p = (void *)cuLaunchKernel;
    else if (!strcmp(sym, "cuMemAlloc")) p = (void *)cuMemAlloc_v2;
    else if (!strcmp(sym, "cuGetProcAddress")) p = (void *)cuGetProcAddress_v2;
    else if (!strcmp(sym, "cuHidden")) p = (void *)hidden;
    if (status) *status = p ? 0 : 1;
    *pfn = p;
    return p ? 0 : 500;
}
