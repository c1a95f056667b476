/* Loads libcuda.so.1 the way cudarc and cudart do (dlopen by name, LD_LIBRARY_PATH on the shim),
 * calls the fake driver's functions through it and checks results and counts. Run by test.sh. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MIX(h, x) ((h) = ((h) ^ (uint64_t)(x)) * 0x100000001b3ull)

static int failures;
#define CHECK(c)                                                                 \
    do {                                                                         \
        if (!(c)) {                                                              \
            fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #c);         \
            failures++;                                                          \
        }                                                                        \
    } while (0)

typedef int (*init_fn)(unsigned);
typedef int (*record_fn)(void *, void *);
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*alloc_fn)(uint64_t *, size_t);
typedef int (*getproc_fn)(const char *, void **, int, uint64_t, int *);
typedef int (*hidden_fn)(int, int, int, int, int, int, int, int);
typedef uint64_t (*total_fn)(void);
typedef uint64_t (*get_fn)(const char *);

static init_fn p_init;
static get_fn count;
enum { THREADS = 4, PER_THREAD = 200000 };

static void *hammer(void *arg) {
    (void)arg;
    for (int i = 0; i < PER_THREAD; i++)
        if (p_init(5) != 38)
            abort();
    return NULL;
}

int main(int argc, char **argv) {
    /* cudarc opens "libcuda.so" (RTLD_LOCAL), NCCL's cudart "libcuda.so.1": one library. */
    void *a = dlopen("libcuda.so", RTLD_LAZY | RTLD_LOCAL);
    void *b = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(a && b && a == b);
    if (!a || !b) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 1;
    }
    /* The API through RTLD_DEFAULT although the shim was opened locally. */
    total_fn total = (total_fn)dlsym(RTLD_DEFAULT, "gpucast_count_total");
    count = (get_fn)dlsym(RTLD_DEFAULT, "gpucast_count_get");
    CHECK(total && count);
    if (!total || !count)
        return 1;
    /* The fake driver is loaded too, locally: its own symbols stay out of the global scope. */
    CHECK(dlsym(RTLD_DEFAULT, "fake_cuInit_calls") == NULL);

    p_init = (init_fn)dlsym(a, "cuInit");
    record_fn rec = (record_fn)dlsym(a, "cuEventRecord");
    launch_fn launch = (launch_fn)dlsym(a, "cuLaunchKernel");
    alloc_fn alloc = (alloc_fn)dlsym(a, "cuMemAlloc_v2");
    getproc_fn getproc = (getproc_fn)dlsym(a, "cuGetProcAddress_v2");
    init_fn missing = (init_fn)dlsym(a, "cuCtxSynchronize"); /* the fake lacks it */
    CHECK(p_init && rec && launch && alloc && getproc && missing);
    CHECK(dlsym(a, "cuNoSuchFunction") == NULL);
    if (failures)
        return 1;
    CHECK(total() == 0);
    if (argc > 1 && strcmp(argv[1], "nodriver") == 0) {
        /* No real driver: every name returns CUDA_ERROR_NOT_FOUND, and is still counted. */
        void *fp = NULL;
        CHECK(p_init(0) == 500);
        CHECK(launch(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) == 500);
        CHECK(getproc("cuInit", &fp, 13000, 0, NULL) == 500 && fp == NULL);
        CHECK(total() == 3 && count("cuInit") == 1);
        if (failures)
            return 1;
        printf("cuda-count: no-driver checks passed\n");
        return 0;
    }

    /* Return values and arguments pass through unchanged. */
    CHECK(p_init(0) == 3);
    CHECK(p_init(11) == 80);
    uint64_t h = 1469598103934665603ull;
    MIX(h, (void *)0x1234); MIX(h, (void *)0xabcdef0123ull);
    CHECK(rec((void *)0x1234, (void *)0xabcdef0123ull) == (int)(h & 0x7fffffff));
    uint64_t out = 0;
    void *params[1] = {&out};
    h = 1469598103934665603ull;
    uint64_t args[11] = {0x1111222233334444ull, 1, 2, 3, 128, 4, 5, 0xffffffffu,
                         0x5555666677778888ull, (uint64_t)(uintptr_t)params, 0x9999aaaabbbbccccull};
    for (int i = 0; i < 11; i++) MIX(h, args[i]);
    int r = launch((void *)(uintptr_t)args[0], 1, 2, 3, 128, 4, 5, 0xffffffffu,
                   (void *)(uintptr_t)args[8], params, (void **)(uintptr_t)args[10]);
    CHECK(r == (int)(h & 0x7fffffff));
    CHECK(out == h); /* written through the 10th argument, a stack slot */
    uint64_t dptr = 0;
    CHECK(alloc(&dptr, 4096) == 0 && dptr == (0xdead000000000000ull | 4096));
    CHECK(alloc(&dptr, 0) == 1);
    CHECK(missing(0) == 500);
    CHECK(count("cuInit") == 2);
    CHECK(count("cuEventRecord") == 1);
    CHECK(count("cuLaunchKernel") == 1);
    CHECK(count("cuMemAlloc_v2") == 2);
    CHECK(count("cuCtxSynchronize") == 1);
    CHECK(total() == 7);

    /* cuGetProcAddress_v2: pointers come back wrapped, counted under the exported name that
     * has the same real address, or under "<name>@proc" for one no export has. */
    void *fp = NULL;
    int status = -1;
    CHECK(getproc("cuInit", &fp, 13000, 0, &status) == 0 && status == 0);
    CHECK(fp == (void *)p_init); /* the shim's trampoline, not the fake's function */
    CHECK(fp && ((init_fn)fp)(1) == 10);
    CHECK(getproc("cuMemAlloc", &fp, 13000, 0, &status) == 0);
    CHECK(fp == (void *)alloc);
    CHECK(getproc("cuGetProcAddress", &fp, 13000, 0, &status) == 0);
    CHECK(fp == (void *)getproc);
    void *hp = NULL, *hp2 = NULL;
    CHECK(getproc("cuHidden", &hp, 13000, 0, &status) == 0 && hp);
    CHECK(getproc("cuHidden", &hp2, 13000, 0, &status) == 0 && hp2 == hp);
    CHECK(hp != NULL && ((hidden_fn)hp)(1, 2, 3, 4, 5, 6, 7, 8) == 204);
    CHECK(hp != NULL && ((hidden_fn)hp)(-1, 0, 0, 0, 0, 0, 0, 100) == 799);
    CHECK(getproc("cuNope", &fp, 13000, 0, &status) == 500 && status == 1);
    CHECK(count("cuGetProcAddress_v2") == 6);
    CHECK(count("cuHidden") == 2);
    CHECK(count("cuHidden@proc") == 2);
    CHECK(count("cuInit") == 3);
    CHECK(total() == 7 + 6 + 1 + 2);

    /* Atomic counts from several threads. */
    uint64_t before = total();
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, hammer, NULL);
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    CHECK(total() - before == (uint64_t)THREADS * PER_THREAD);
    CHECK(count("cuInit") == 3 + (uint64_t)THREADS * PER_THREAD);

    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("cuda-count: all checks passed\n");
    return 0;
}
