/* Weight-streaming matrix products for decode steps: Y[m] = W X[m] for a few rows X[m].
 *
 * W is row-major [n_out, n_in] float32; X is [M, n_in], Y is [M, n_out]. A decode step (M = 1)
 * or a small verification pass (M <= 16 or so) reads every weight once and does little
 * arithmetic with it, so the speed is set by how fast weights stream from memory. Blocks of
 * four weight rows are read side by side (four streams keep more loads in flight), each block
 * is applied to the inputs four at a time while it sits in L1, and blocks are split between
 * threads with OpenMP (inside torch's process this is torch's own OpenMP runtime).
 *
 * Every output is summed in the same order whatever M is (16 lanes of partial sums, then one
 * horizontal sum), so a token's projections in a multi-token pass are bit-identical to those
 * of a one-token step.
 */
#include <immintrin.h>
#include <stddef.h>

static inline __attribute__((always_inline)) void block(
    const float *w, const float *x, float *y, int n_in, int n_out, const int R, const int M) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n_in; i += 16) {
        __m512 wv[4];
        for (int r = 0; r < R; r++) wv[r] = _mm512_loadu_ps(w + (size_t)r * n_in + i);
        for (int m = 0; m < M; m++) {
            __m512 xv = _mm512_loadu_ps(x + (size_t)m * n_in + i);
            for (int r = 0; r < R; r++) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
        }
    }
    if (i < n_in) {
        __mmask16 mask = (__mmask16)((1u << (n_in - i)) - 1u);
        __m512 wv[4];
        for (int r = 0; r < R; r++) wv[r] = _mm512_maskz_loadu_ps(mask, w + (size_t)r * n_in + i);
        for (int m = 0; m < M; m++) {
            __m512 xv = _mm512_maskz_loadu_ps(mask, x + (size_t)m * n_in + i);
            for (int r = 0; r < R; r++) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) y[(size_t)m * n_out + r] = _mm512_reduce_add_ps(acc[r][m]);
}

/* Rows [row, row + R) of W against all M inputs, four inputs at a time. */
static void rows(const float *w, const float *x, float *y, int n_in, int n_out, int row, int R, int M) {
    const float *wr = w + (size_t)row * n_in;
    for (int m0 = 0; m0 < M; m0 += 4) {
        const float *xm = x + (size_t)m0 * n_in;
        float *ym = y + (size_t)m0 * n_out + row;
        int left = M - m0 < 4 ? M - m0 : 4;
        if (R == 4) {
            switch (left) {
                case 1: block(wr, xm, ym, n_in, n_out, 4, 1); break;
                case 2: block(wr, xm, ym, n_in, n_out, 4, 2); break;
                case 3: block(wr, xm, ym, n_in, n_out, 4, 3); break;
                default: block(wr, xm, ym, n_in, n_out, 4, 4); break;
            }
        } else {
            for (int m = 0; m < left; m++)
                block(wr, xm + (size_t)m * n_in, ym + (size_t)m * n_out, n_in, n_out, 1, 1);
        }
    }
}

void decodekit_gemm_f32(const float *w, const float *x, float *y, int M, int n_out, int n_in, int threads) {
    int blocks = n_out / 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int b = 0; b < blocks; b++) rows(w, x, y, n_in, n_out, 4 * b, 4, M);
    for (int r = 4 * blocks; r < n_out; r++) rows(w, x, y, n_in, n_out, r, 1, M);
}
