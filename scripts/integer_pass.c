/* The integer kernel (gemm_q8.c) on all of SmolLM2-135M's projections, with random blocks, for
 * passes of 1 to 64 rows: one or more builds of the kernel loaded side by side (dlopen) and timed
 * in turn, pass by pass, so that the machine's drift falls on all of them alike. Driven by
 * scripts/integer_pass.sh, which builds the libraries; see there.
 *
 *   integer_pass THREADS PASSES LIB.so [LIB.so ...]      (HOT=1: one layer's matrices 30 times,
 *                                                         so the weights come from the caches)
 * Prints, per pass size and library, the fastest pass of the 30 Q4_1 layers and of the Q8_0 head,
 * the multiply-add rate, whether each library's output equals the first's bit for bit, and the
 * rate of a loop of nothing but vpdpbusd (decodekit_q8_peak). */
#include <dlfcn.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*matmul_fn)(const uint8_t *, const float *, float *, int, int, int, int);
typedef void (*pack_fn)(int, const uint8_t *, uint8_t *, int, int);
typedef int64_t (*bytes_fn)(int, int, int);
typedef int64_t (*peak_fn)(int64_t, int);

enum { Q4_1 = 0, Q8_0 = 1, LAYERS = 30, MAX_LIBS = 8 };
static const int SHAPES[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}}; /* qkv, o, gate_up, down */

typedef struct {
    int n_out, n_in;
    uint8_t *packed;
} Matrix;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Random file blocks (Q4_1: {d, m, 16 bytes}; Q8_0: {d, 32 bytes}), packed by the first library. */
static Matrix random_matrix(int kind, int n_out, int n_in, unsigned seed, bytes_fn bytes, pack_fn pack) {
    int block = kind == Q4_1 ? 20 : 34;
    size_t row = (size_t)(n_in / 32) * block;
    uint8_t *file = malloc(row * n_out);
    srand(seed);
    for (int r = 0; r < n_out; r++)
        for (int b = 0; b < n_in / 32; b++) {
            uint8_t *at = file + r * row + b * block;
            uint16_t d = _cvtss_sh(0.01f + 0.01f * (rand() % 100) / 100.f, 0), m = _cvtss_sh(-0.05f, 0);
            memcpy(at, &d, 2);
            if (kind == Q4_1) memcpy(at + 2, &m, 2);
            for (int k = kind == Q4_1 ? 4 : 2; k < block; k++) at[k] = (uint8_t)rand();
        }
    Matrix m = {n_out, n_in, aligned_alloc(64, (bytes(kind, n_out, n_in) + 63) / 64 * 64)};
    pack(kind, file, m.packed, n_out, n_in);
    free(file);
    return m;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: integer_pass THREADS PASSES LIB.so [LIB.so ...]\n");
        return 2;
    }
    int threads = atoi(argv[1]), passes = atoi(argv[2]), libs = argc - 3, hot = getenv("HOT") != NULL;
    if (libs > MAX_LIBS) libs = MAX_LIBS;
    matmul_fn q4_1[MAX_LIBS], q8_0[MAX_LIBS];
    bytes_fn bytes = NULL;
    pack_fn pack = NULL;
    peak_fn peak = NULL;
    for (int i = 0; i < libs; i++) {
        void *lib = dlopen(argv[3 + i], RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            fprintf(stderr, "%s\n", dlerror());
            return 1;
        }
        q4_1[i] = (matmul_fn)dlsym(lib, "decodekit_q8_q4_1"), q8_0[i] = (matmul_fn)dlsym(lib, "decodekit_q8_q8_0");
        if (i == 0) {
            bytes = (bytes_fn)dlsym(lib, "decodekit_q8_packed_bytes"), pack = (pack_fn)dlsym(lib, "decodekit_q8_pack");
            peak = (peak_fn)dlsym(lib, "decodekit_q8_peak");
        }
    }
    Matrix layers[LAYERS][4];
    for (int l = 0; l < LAYERS; l++)
        for (int j = 0; j < 4; j++)
            layers[l][j] = hot && l ? layers[0][j] : random_matrix(Q4_1, SHAPES[j][0], SHAPES[j][1], 4 * l + j, bytes, pack);
    Matrix head = random_matrix(Q8_0, 49152, 576, 999, bytes, pack);
    float *x = malloc(64 * 3072 * sizeof(float)), *y = malloc(64 * 49152 * sizeof(float)), *first = malloc(64 * 3072 * sizeof(float));
    for (int i = 0; i < 64 * 3072; i++) x[i] = (float)(rand() % 2000 - 1000) / 1000.f;
    double layer_macs = 0;
    for (int j = 0; j < 4; j++) layer_macs += (double)LAYERS * SHAPES[j][0] * SHAPES[j][1];
    const int rows[] = {1, 2, 3, 4, 8, 16, 32, 64};
    printf("%s weights, %d threads, fastest of %d passes\n", hot ? "cached (HOT=1)" : "streamed", threads, passes);
    for (int s = 0; s < (int)(sizeof rows / sizeof rows[0]); s++) {
        int m = rows[s];
        double best_layers[MAX_LIBS], best_head[MAX_LIBS];
        for (int i = 0; i < libs; i++) best_layers[i] = best_head[i] = 1e9;
        for (int p = 0; p < passes; p++)
            for (int i = 0; i < libs; i++) {
                double t0 = now();
                for (int l = 0; l < LAYERS; l++)
                    for (int j = 0; j < 4; j++)
                        q4_1[i](layers[l][j].packed, x, y, m, layers[l][j].n_out, layers[l][j].n_in, threads);
                double t1 = now();
                q8_0[i](head.packed, x, y, m, 49152, 576, threads);
                double t2 = now();
                if (t1 - t0 < best_layers[i]) best_layers[i] = t1 - t0;
                if (t2 - t1 < best_head[i]) best_head[i] = t2 - t1;
            }
        printf("rows %2d", m);
        for (int i = 0; i < libs; i++) {
            q4_1[i](layers[0][2].packed, x, i ? y : first, m, 3072, 576, threads);
            int same = i == 0 || memcmp(y, first, (size_t)m * 3072 * sizeof(float)) == 0;
            printf(" | lib %d: layers %.3f ms (%.0f G multiply-adds/s), head %.3f ms%s", i, best_layers[i] * 1e3,
                   layer_macs * m / best_layers[i] / 1e9, best_head[i] * 1e3, same ? "" : ", NOT BIT-IDENTICAL");
        }
        printf("\n");
    }
    int64_t rounds = 20000000;
    double t0 = now();
    volatile int64_t sink = peak(rounds, threads);
    (void)sink;
    printf("vpdpbusd loop: %.0f G multiply-adds/s (%d threads)\n", rounds * 12.0 * 64 * threads / (now() - t0) / 1e9, threads);
    return 0;
}
