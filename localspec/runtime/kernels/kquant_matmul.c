/* Matrix products over GGUF Q4_K, Q5_K, Q6_K, Q8_0 and Q4_0 weights and Q3_M (block layouts
 * in kernels.h).
 *
 * y[m, n] = sum_k x[m, k] * w[n, k], with w exactly as the file stores it. The activations are
 * quantized here to int8 with one scale per group of 32 (as llama.cpp's Q8_0), so a single
 * outlier only coarsens its own group. Each group's product is an exact int32 sum; the float
 * work per group and row is the same whatever the number of rows M or threads, so a row's
 * output is bit for bit the same in a one-token step and inside a verify pass.
 *
 * The inner loops come in one header per variant (kquant_avx512.h, kquant_avx2.h,
 * kquant_portable.h), all with the same float operations on each output lane: the variants
 * give the same bits (the helpers they all use are in kquant_common.h). This file is what
 * calls them: quantizing the activations, splitting the output blocks between threads, the
 * exported functions.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "kquant_common.h"

#if defined(KERNELS_AVX512)
#include "kquant_avx512.h"
#elif defined(KERNELS_AVX2)
#include "kquant_avx2.h"
#else
#include "kquant_portable.h"
#endif

/* Per row m and group g (see Scratch in kernels.h): group-major, so the rows a block takes
 * for one group lie side by side, one base pointer and constant offsets (row-major would
 * need eight live row pointers, which the compiler spills: 8% slower from 8 rows on). */
static void quantize_rows(const float *x, int64_t m_rows, int64_t k, int8_t *xq, float *xs,
                          float *xsum, int32_t *xsum16, int threads) {
    const int64_t groups = k / GROUP;
    (void)threads;  /* unused where there is no OpenMP */
#pragma omp parallel for num_threads(threads) schedule(static) if (m_rows * k >= 32768)
    for (int64_t at = 0; at < m_rows * groups; at++) {
        const int64_t m = at / groups, g = at % groups;
        int32_t sums[2];
        const float amax = quantize_group(x + m * k + g * GROUP, xq + (g * m_rows + m) * GROUP,
                                          sums);
        if (xsum16) {  /* Q6_K's sums per 16 inputs */
            xsum16[2 * (g * m_rows + m)] = sums[0];
            xsum16[2 * (g * m_rows + m) + 1] = sums[1];
        }
        const float scale = amax / 127.0f;
        xs[g * m_rows + m] = scale;
        xsum[g * m_rows + m] = scale * (float)(sums[0] + sums[1]);
    }
}

int scratch_make(Scratch *s, const float *x, int64_t m_rows, int64_t k, int with_sums16,
                 int threads) {
    const int64_t groups = k / GROUP;
    s->xq = malloc((size_t)(m_rows * k));
    s->xs = malloc(sizeof(float) * (size_t)(m_rows * groups));
    s->xsum = malloc(sizeof(float) * (size_t)(m_rows * groups));
    s->xsum16 = with_sums16 ? malloc(sizeof(int32_t) * (size_t)(m_rows * groups * 2)) : NULL;
    if (!s->xq || !s->xs || !s->xsum || (with_sums16 && !s->xsum16)) return -1;
    quantize_rows(x, m_rows, k, s->xq, s->xs, s->xsum, s->xsum16, threads);
    return 0;
}

void scratch_free(Scratch *s) {
    free(s->xq);
    free(s->xs);
    free(s->xsum);
    free(s->xsum16);
}

/* Every 16-row block of outputs, ROWS_PER_PASS input rows at a time, split between threads;
 * CALL(R) handles R rows from m0 of block b, R a constant so that accumulators stay in
 * registers. */
#if ROWS_PER_PASS > 4
#define WIDE_ROWS(CALL) CALL(5) CALL(6) CALL(7) CALL(8)
#else
#define WIDE_ROWS(CALL)
#endif
#define FOR_BLOCKS(CALL)                                                                    \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                       \
    for (int64_t b = 0; b < n / BLOCK_ROWS; b++) {                                          \
        for (int64_t m0 = 0; m0 < m_rows; m0 += ROWS_PER_PASS) {                            \
            switch (m_rows - m0 < ROWS_PER_PASS ? m_rows - m0 : ROWS_PER_PASS) {            \
                CALL(1) CALL(2) CALL(3) CALL(4) WIDE_ROWS(CALL)                             \
            }                                                                               \
        }                                                                                   \
    }

void kquant_run(const Scratch *s, int bits, int64_t m_rows, int64_t k, const uint8_t *qs,
                const uint8_t *sc, const uint8_t *mn, const float *d, const float *dmin,
                int64_t n, float *y, int64_t ldy, int threads) {
    (void)threads;
#define KQ(R, BITS) case R: block_rows(qs, BITS, sc, mn, d, dmin, s->xq, s->xs, s->xsum, y, b, \
                                       m0, R, ldy, k, m_rows); break;
#define Q4(R) KQ(R, 4)
#define Q5(R) KQ(R, 5)
#define Q3(R) KQ(R, 3)
    if (bits == 4) {
        FOR_BLOCKS(Q4)
    } else if (bits == 5) {
        FOR_BLOCKS(Q5)
    } else {
        FOR_BLOCKS(Q3)
    }
#undef Q3
#undef Q5
#undef Q4
#undef KQ
}

void q32_run(const Scratch *s, int bits, int64_t m_rows, int64_t k, const uint8_t *qs,
             const float *d, int64_t n, float *y, int64_t ldy, int threads) {
    (void)threads;
#define Q8(R) case R: q32_block_rows(qs, 8, d, s->xq, s->xs, s->xsum16, y, b, m0, R, ldy, k, \
                                     m_rows); break;
#define Q40(R) case R: q32_block_rows(qs, 4, d, s->xq, s->xs, s->xsum16, y, b, m0, R, ldy, k, \
                                      m_rows); break;
    if (bits == 8) {
        FOR_BLOCKS(Q8)
    } else {
        FOR_BLOCKS(Q40)
    }
#undef Q8
#undef Q40
}

void q6k_run(const Scratch *s, int64_t m_rows, int64_t k, const uint8_t *qs, const uint8_t *qh,
             const int8_t *sc, const float *d, int64_t n, float *y, int64_t ldy, int threads) {
    (void)threads;
#define Q6(R) case R: q6_block_rows(qs, qh, sc, d, s->xq, s->xs, s->xsum16, y, b, m0, R, ldy, \
                                    k, m_rows); break;
    FOR_BLOCKS(Q6)
#undef Q6
}

static int kquant_linear(int bits, const float *x, int64_t m_rows, int64_t k,
                         const uint8_t *qs, const uint8_t *sc, const uint8_t *mn, const float *d,
                         const float *dmin, int64_t n, float *y, int threads) {
    Scratch s;
    int ok = scratch_make(&s, x, m_rows, k, 0, threads) == 0;
    if (ok) kquant_run(&s, bits, m_rows, k, qs, sc, mn, d, dmin, n, y, n, threads);
    scratch_free(&s);
    return ok ? 0 : -1;
}

int q4k_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs, const uint8_t *sc,
               const uint8_t *mn, const float *d, const float *dmin, int64_t n, float *y,
               int threads) {
    return kquant_linear(4, x, m_rows, k, qs, sc, mn, d, dmin, n, y, threads);
}

int q5k_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs, const uint8_t *sc,
               const uint8_t *mn, const float *d, const float *dmin, int64_t n, float *y,
               int threads) {
    return kquant_linear(5, x, m_rows, k, qs, sc, mn, d, dmin, n, y, threads);
}

int q3m_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs, const uint8_t *sc,
               const uint8_t *mn, const float *d, const float *dmin, int64_t n, float *y,
               int threads) {
    return kquant_linear(3, x, m_rows, k, qs, sc, mn, d, dmin, n, y, threads);
}

int q6k_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs, const uint8_t *qh,
               const int8_t *sc, const float *d, int64_t n, float *y, int threads) {
    Scratch s;
    int ok = scratch_make(&s, x, m_rows, k, 1, threads) == 0;
    if (ok) q6k_run(&s, m_rows, k, qs, qh, sc, d, n, y, n, threads);
    scratch_free(&s);
    return ok ? 0 : -1;
}

static int q32_linear(int bits, const float *x, int64_t m_rows, int64_t k, const uint8_t *qs,
                      const float *d, int64_t n, float *y, int threads) {
    Scratch s;
    int ok = scratch_make(&s, x, m_rows, k, 1, threads) == 0;
    if (ok) q32_run(&s, bits, m_rows, k, qs, d, n, y, n, threads);
    scratch_free(&s);
    return ok ? 0 : -1;
}

int q8_0_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs, const float *d,
                int64_t n, float *y, int threads) {
    return q32_linear(8, x, m_rows, k, qs, d, n, y, threads);
}

int q4_0_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs, const float *d,
                int64_t n, float *y, int threads) {
    return q32_linear(4, x, m_rows, k, qs, d, n, y, threads);
}

int64_t kernels_rows_per_pass(void) { return ROWS_PER_PASS; }
