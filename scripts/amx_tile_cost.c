/* What Intel AMX's tile operations cost on this CPU, for the question of whether the `fast`
 * numerics' passes of several rows (gemm_q8.c) could run on the tile unit (docs/BENCHMARKS.md,
 * "AMX tried"). The numerics need one int32 sum per input row, output row and block of 32 inputs
 * (each block has its own scales), so each tile multiply (K = 32) must be stored to memory before
 * the float arithmetic can scale it. Prints nanoseconds per operation, one thread:
 *   mode 0: load inputs and weights, zero, multiply (tdpbsud), store the sums (what a block costs)
 *   mode 1: the same without the store;  mode 2: the two loads only;  mode 3: the store only
 * for T = 2, 8 and 16 input rows (the tiles' rows), alternating two sets of tiles.
 *
 *     cc -O2 -mamx-tile -mamx-int8 scripts/amx_tile_cost.c -o /tmp/amx_tile_cost && /tmp/amx_tile_cost
 *
 * Linux only (it asks the kernel for the tile state with arch_prctl); exits 2 where AMX is absent. */
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

static int8_t inputs[16 * 2048] __attribute__((aligned(64)));
static uint8_t weights[64 * 512] __attribute__((aligned(64)));
static int32_t sums[64][16][16] __attribute__((aligned(64)));

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define OP(SUM, IN, W, o, mode)                                                                     \
    do {                                                                                            \
        if ((mode) != 3) {                                                                          \
            _tile_loadd(IN, inputs + 32 * ((o) & 31), 2048);                                        \
            _tile_loadd(W, weights + 512 * (o), 64);                                                \
        }                                                                                           \
        if ((mode) <= 1) {                                                                          \
            _tile_zero(SUM);                                                                        \
            _tile_dpbsud(SUM, IN, W);                                                               \
        }                                                                                           \
        if ((mode) == 0 || (mode) == 3) _tile_stored(SUM, sums[o], 64);                            \
    } while (0)

static double ns_per_op(int mode) {
    const long n = 2000000;
    double start = seconds();
    for (long i = 0; i < n; i += 2) {
        int o = (int)(i & 63);
        OP(0, 2, 4, o, mode);
        OP(1, 3, 5, o + 1, mode);
    }
    return (seconds() - start) / n * 1e9;
}

int main(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1) ||
        syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
        fprintf(stderr, "no AMX-INT8 on this CPU or system\n");
        return 2;
    }
    int rows[] = {2, 8, 16};
    for (int r = 0; r < 3; r++) {
        TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 2; t++) cfg.rows[t] = (uint8_t)rows[r], cfg.colsb[t] = 64; /* sums, 16 int32 a row */
        for (int t = 2; t < 4; t++) cfg.rows[t] = (uint8_t)rows[r], cfg.colsb[t] = 32; /* a block of inputs a row */
        for (int t = 4; t < 6; t++) cfg.rows[t] = 8, cfg.colsb[t] = 64;                /* 32 weights of 16 outputs */
        _tile_loadconfig(&cfg);
        printf("T=%2d  block %.2f ns  without the store %.2f  loads %.2f  store %.2f\n", rows[r], ns_per_op(0),
               ns_per_op(1), ns_per_op(2), ns_per_op(3));
        _tile_release();
    }
    return 0;
}
