/* The lean CPU forward's native code: W4A8 matrix products over GGUF Q4_K and Q6_K weights,
 * attention over a bf16 KV cache, and the whole decoder stack in one call (at the end).
 * For CPUs with AVX-512 VNNI (or AVX2, built with -DQ4K_AVX2: the same bits, see the variants
 * below).
 *
 * y[m, n] = sum_k x[m, k] * w[n, k], where w is stored exactly as a Q4_K file has it:
 * w = d * sc_g * q - dmin * mn_g, q in 0..15, one (sc, mn) pair of 6-bit integers per group
 * of 32 inputs and one (d, dmin) pair per 256. The activations are quantized here to int8 with
 * one scale per group of 32 (as llama.cpp's Q8_0), so a single outlier only coarsens its own
 * group. Each group's product is an exact int32 sum (VPDPBUSD: u8 weights times s8 inputs);
 * the float work per group and row is the same whatever the number of rows M or threads, so a
 * row's output is bit for bit the same in a one-token step and inside a verify pass.
 *
 * Layout (made by localspec.runtime.kernels.pack_q4k): rows in blocks of 16, groups of 32.
 *   qs  [N/16][K/32][4][64] u8: load i of a group holds, at byte 4*r + j, the low nibble
 *       q[r][8i + j] and the high nibble q[r][8i + 4 + j] (r: row in block, j: 0..3), so that
 *       one 64-byte load makes two VNNI operands of 16 rows x 4 inputs.
 *   sc, mn [N/16][K/32][16] u8;  d, dmin [N/16][ceil(K/256)][16] f32 (a width that is not a
 *   multiple of 256, such as 896, ends in a partial super-block).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS_PER_PASS 8
#ifndef PREFETCH
#define PREFETCH 8
#endif

/* Per row m and group g: int8 inputs xq, their scale xs and scale * sum(xq) (for the mins),
 * stored group-major (xq [K/32][m_rows][32], xs and xsum [K/32][m_rows]): the rows a block
 * takes for one group lie side by side, one base pointer and constant offsets (row-major, the
 * compiler kept eight row pointers and spilled them: 8% slower from 8 rows on). */
static void quantize_rows(const float *x, int64_t m_rows, int64_t k, int8_t *xq, float *xs,
                          float *xsum, int32_t *xsum16, int threads) {
    const int64_t groups = k / 32;
    /* vectorized, and the same bits as nearbyintf per element: a product rounded to float,
     * then to an integer in the current (nearest-even) mode, as CVTPS2DQ does */
#pragma omp parallel for num_threads(threads) schedule(static) if (m_rows * k >= 32768)
    for (int64_t at = 0; at < m_rows * groups; at++) {
        const int64_t m = at / groups, g = at % groups;
        const float *src = x + m * k + g * 32;
        int8_t *dst = xq + (g * m_rows + m) * 32;
#ifndef Q4K_AVX2
        const __m512 v0 = _mm512_loadu_ps(src), v1 = _mm512_loadu_ps(src + 16);
        /* a maximum is exact in any order; max(|x|, m) keeps m for a NaN, as the C loop did */
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(
            _mm512_abs_ps(v1), _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps())));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
        const __m512i q0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv))), lo), hi);
        const __m512i q1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv))), lo), hi);
        _mm_storeu_si128((__m128i *)dst, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(dst + 16), _mm512_cvtepi32_epi8(q1));
        const int32_t first = _mm512_reduce_add_epi32(q0), second = _mm512_reduce_add_epi32(q1);
#else
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4], top = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(src + 8 * i);
            top = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), top);
        }
        float lanes[8], amax = 0.0f;
        _mm256_storeu_ps(lanes, top);
        for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
        int32_t q[32], first = 0, second = 0;
        for (int i = 0; i < 4; i++)
            _mm256_storeu_si256((__m256i *)(q + 8 * i), _mm256_min_epi32(_mm256_max_epi32(
                _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv))), lo), hi));
        for (int j = 0; j < 32; j++) dst[j] = (int8_t)q[j];
        for (int j = 0; j < 16; j++) {
            first += q[j];
            second += q[16 + j];
        }
#endif
        const int32_t total = first + second;
        if (xsum16) {  /* Q6_K's sums per 16 inputs */
            xsum16[2 * (g * m_rows + m)] = first;
            xsum16[2 * (g * m_rows + m) + 1] = second;
        }
        const float scale = amax / 127.0f;
        xs[g * m_rows + m] = scale;
        xsum[g * m_rows + m] = scale * (float)total;
    }
}

#ifndef Q4K_AVX2
/* Rows m0..m0+rows-1 of block b: 16 outputs each. Always inlined with a constant ``rows``,
 * so that the accumulators live in registers. */
static inline __attribute__((always_inline)) void block_rows(const uint8_t *qs, const uint8_t *sc, const uint8_t *mn,
                              const float *d, const float *dmin, const int8_t *xq,
                              const float *xs, const float *xsum, float *y, int64_t b,
                              int64_t m0, int rows, int64_t ldy, int64_t k, int64_t m_rows) {
    const int64_t groups = k / 32, supers = (groups + 7) / 8;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 out[ROWS_PER_PASS];
    for (int r = 0; r < rows; r++) out[r] = _mm512_setzero_ps();
    const uint8_t *wq = qs + b * groups * 256;
    const uint8_t *wsc = sc + b * groups * 16;
    const uint8_t *wmn = mn + b * groups * 16;
    __m512 vd = _mm512_setzero_ps(), vdmin = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if ((g & 7) == 0) {
            vd = _mm512_loadu_ps(d + (b * supers + g / 8) * 16);
            vdmin = _mm512_loadu_ps(dmin + (b * supers + g / 8) * 16);
        }
        __m512i acc[ROWS_PER_PASS];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(wq + (g + PREFETCH) * 256 + i * 64), _MM_HINT_T0);
        for (int i = 0; i < 4; i++) {
            __m512i v = _mm512_loadu_si512((const void *)(wq + g * 256 + i * 64));
            __m512i w0 = _mm512_and_si512(v, low);
            __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int r = 0; r < rows; r++) {
                const int8_t *a = xq + (g * m_rows + m0 + r) * 32 + 8 * i;
                __m512i a0 = _mm512_set1_epi32(*(const int32_t *)a);
                __m512i a1 = _mm512_set1_epi32(*(const int32_t *)(a + 4));
                acc[r] = _mm512_dpbusd_epi32(acc[r], w0, a0);
                acc[r] = _mm512_dpbusd_epi32(acc[r], w1, a1);
            }
        }
        __m512 vsc = _mm512_mul_ps(
            vd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(wsc + g * 16)))));
        __m512 vmn = _mm512_mul_ps(
            vdmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(wmn + g * 16)))));
        for (int r = 0; r < rows; r++) {
            int64_t at = g * m_rows + m0 + r;
            __m512 s = _mm512_mul_ps(vsc, _mm512_set1_ps(xs[at]));
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), s, out[r]);
            out[r] = _mm512_fnmadd_ps(vmn, _mm512_set1_ps(xsum[at]), out[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + (m0 + r) * ldy + b * 16, out[r]);
}

#else
/* The AVX2 variant (CPUs without AVX-512 VNNI): the same integer sums, made with
 * VPMADDUBSW (u8 x s8 pairs, at most 2 * 15 * 127: no saturation) and VPMADDWD, and the same
 * float operations on each lane, so its output is bit for bit the AVX-512 one. It takes the
 * 16-row blocks in two halves of 8 rows (bytes 0..31 and 32..63 of each 64-byte load). */
#undef ROWS_PER_PASS
#define ROWS_PER_PASS 4
static inline __attribute__((always_inline)) void block_rows(
        const uint8_t *qs, const uint8_t *sc, const uint8_t *mn, const float *d,
        const float *dmin, const int8_t *xq, const float *xs, const float *xsum, float *y,
        int64_t b, int64_t m0, int rows, int64_t ldy, int64_t k, int64_t m_rows) {
    const int64_t groups = k / 32, supers = (groups + 7) / 8;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256 out[ROWS_PER_PASS];
        for (int r = 0; r < rows; r++) out[r] = _mm256_setzero_ps();
        const uint8_t *wq = qs + b * groups * 256 + h * 32;
        const uint8_t *wsc = sc + b * groups * 16 + h * 8;
        const uint8_t *wmn = mn + b * groups * 16 + h * 8;
        __m256 vd = _mm256_setzero_ps(), vdmin = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            if ((g & 7) == 0) {
                vd = _mm256_loadu_ps(d + (b * supers + g / 8) * 16 + h * 8);
                vdmin = _mm256_loadu_ps(dmin + (b * supers + g / 8) * 16 + h * 8);
            }
            __m256i acc[ROWS_PER_PASS];
            for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                _mm_prefetch((const char *)(wq + (g + PREFETCH) * 256 + i * 64), _MM_HINT_T0);
                __m256i v = _mm256_loadu_si256((const void *)(wq + g * 256 + i * 64));
                __m256i w0 = _mm256_and_si256(v, low);
                __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                for (int r = 0; r < rows; r++) {
                    const int8_t *a = xq + (g * m_rows + m0 + r) * 32 + 8 * i;
                    __m256i a0 = _mm256_set1_epi32(*(const int32_t *)a);
                    __m256i a1 = _mm256_set1_epi32(*(const int32_t *)(a + 4));
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(w0, a0), ones));
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(w1, a1), ones));
                }
            }
            __m256 vsc = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                _mm_loadl_epi64((const void *)(wsc + g * 16)))));
            __m256 vmn = _mm256_mul_ps(vdmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                _mm_loadl_epi64((const void *)(wmn + g * 16)))));
            for (int r = 0; r < rows; r++) {
                int64_t at = g * m_rows + m0 + r;
                __m256 s = _mm256_mul_ps(vsc, _mm256_set1_ps(xs[at]));
                out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), s, out[r]);
                out[r] = _mm256_fnmadd_ps(vmn, _mm256_set1_ps(xsum[at]), out[r]);
            }
        }
        for (int r = 0; r < rows; r++)
            _mm256_storeu_ps(y + (m0 + r) * ldy + b * 16 + h * 8, out[r]);
    }
}
#endif

/* Q6_K: w = d * sc_h * (q - 32), q in 0..63, one signed 8-bit scale sc_h per 16 inputs and one
 * d per 256. The low 4 bits of q are packed exactly as Q4_K's nibbles (qs above); the top 2
 * bits go in qh [N/16][K/32][2][64]: byte p of vector t (t = 0, 1) holds, at bits
 * 4 * (i % 2) + 2 * s, the top bits of operand s of load i = 2t + i % 2 at byte p. sc is
 * [N/16][K/16][16] int8, d [N/16][ceil(K/256)][16] f32. Per half-group of 16 inputs the int32
 * sum of q * x minus 32 * sum(x) is exact; it is scaled once, in the same order for any M. */
#ifndef Q4K_AVX2
/* Operand s of load i (ii = i % 2): the low nibble or'ed with the top bits moved to 4..5. */
#define Q6_TOP(hv, sh) ((sh) < 4 ? _mm512_slli_epi16(hv, 4 - (sh)) : \
                        (sh) == 4 ? (hv) : _mm512_srli_epi16(hv, (sh) - 4))
static inline __attribute__((always_inline)) void q6_block_rows(
        const uint8_t *qs, const uint8_t *qh, const int8_t *sc, const float *d,
        const int8_t *xq, const float *xs, const int32_t *xsum16, float *y, int64_t b,
        int64_t m0, int rows, int64_t ldy, int64_t k, int64_t m_rows) {
    const int64_t groups = k / 32, supers = (groups + 7) / 8;
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    __m512 out[ROWS_PER_PASS];
    for (int r = 0; r < rows; r++) out[r] = _mm512_setzero_ps();
    const uint8_t *wq = qs + b * groups * 256, *wh = qh + b * groups * 128;
    const int8_t *wsc = sc + b * groups * 32;
    __m512 vd = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if ((g & 7) == 0) vd = _mm512_loadu_ps(d + (b * supers + g / 8) * 16);
        for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(wq + (g + PREFETCH) * 256 + i * 64), _MM_HINT_T0);
        for (int i = 0; i < 2; i++) _mm_prefetch((const char *)(wh + (g + PREFETCH) * 128 + i * 64), _MM_HINT_T0);
        for (int t = 0; t < 2; t++) {
            const __m512i hv = _mm512_loadu_si512((const void *)(wh + g * 128 + t * 64));
            __m512i acc[ROWS_PER_PASS];
            for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_si512();
            for (int ii = 0; ii < 2; ii++) {
                const int i = 2 * t + ii;
                __m512i v = _mm512_loadu_si512((const void *)(wq + g * 256 + i * 64));
                __m512i w0 = _mm512_or_si512(_mm512_and_si512(v, low),
                                             _mm512_and_si512(Q6_TOP(hv, 4 * ii), top));
                __m512i w1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                             _mm512_and_si512(Q6_TOP(hv, 4 * ii + 2), top));
                for (int r = 0; r < rows; r++) {
                    const int8_t *a = xq + (g * m_rows + m0 + r) * 32 + 8 * i;
                    acc[r] = _mm512_dpbusd_epi32(acc[r], w0, _mm512_set1_epi32(*(const int32_t *)a));
                    acc[r] = _mm512_dpbusd_epi32(acc[r], w1, _mm512_set1_epi32(*(const int32_t *)(a + 4)));
                }
            }
            __m512 vsc = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const void *)(wsc + (2 * g + t) * 16)))));
            for (int r = 0; r < rows; r++) {
                int64_t at = g * m_rows + m0 + r;
                __m512i exact = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(32 * xsum16[2 * at + t]));
                out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact),
                                         _mm512_mul_ps(vsc, _mm512_set1_ps(xs[at])), out[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + (m0 + r) * ldy + b * 16, out[r]);
}
#else
#define Q6_TOP(hv, sh) ((sh) < 4 ? _mm256_slli_epi16(hv, 4 - (sh)) : \
                        (sh) == 4 ? (hv) : _mm256_srli_epi16(hv, (sh) - 4))
static inline __attribute__((always_inline)) void q6_block_rows(
        const uint8_t *qs, const uint8_t *qh, const int8_t *sc, const float *d,
        const int8_t *xq, const float *xs, const int32_t *xsum16, float *y, int64_t b,
        int64_t m0, int rows, int64_t ldy, int64_t k, int64_t m_rows) {
    const int64_t groups = k / 32, supers = (groups + 7) / 8;
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256 out[ROWS_PER_PASS];
        for (int r = 0; r < rows; r++) out[r] = _mm256_setzero_ps();
        const uint8_t *wq = qs + b * groups * 256 + h * 32, *wh = qh + b * groups * 128 + h * 32;
        const int8_t *wsc = sc + b * groups * 32 + h * 8;
        __m256 vd = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            if ((g & 7) == 0) vd = _mm256_loadu_ps(d + (b * supers + g / 8) * 16 + h * 8);
            for (int t = 0; t < 2; t++) {
                _mm_prefetch((const char *)(wq + (g + PREFETCH) * 256 + t * 128), _MM_HINT_T0);
                _mm_prefetch((const char *)(wq + (g + PREFETCH) * 256 + t * 128 + 64), _MM_HINT_T0);
                _mm_prefetch((const char *)(wh + (g + PREFETCH) * 128 + t * 64), _MM_HINT_T0);
                const __m256i hv = _mm256_loadu_si256((const void *)(wh + g * 128 + t * 64));
                __m256i acc[ROWS_PER_PASS];
                for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_si256();
                for (int ii = 0; ii < 2; ii++) {
                    const int i = 2 * t + ii;
                    __m256i v = _mm256_loadu_si256((const void *)(wq + g * 256 + i * 64));
                    __m256i w0 = _mm256_or_si256(_mm256_and_si256(v, low),
                                                 _mm256_and_si256(Q6_TOP(hv, 4 * ii), top));
                    __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                                 _mm256_and_si256(Q6_TOP(hv, 4 * ii + 2), top));
                    for (int r = 0; r < rows; r++) {
                        const int8_t *a = xq + (g * m_rows + m0 + r) * 32 + 8 * i;
                        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(
                            w0, _mm256_set1_epi32(*(const int32_t *)a)), ones));
                        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(
                            w1, _mm256_set1_epi32(*(const int32_t *)(a + 4))), ones));
                    }
                }
                __m256 vsc = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const void *)(wsc + (2 * g + t) * 16)))));
                for (int r = 0; r < rows; r++) {
                    int64_t at = g * m_rows + m0 + r;
                    __m256i exact = _mm256_sub_epi32(acc[r], _mm256_set1_epi32(32 * xsum16[2 * at + t]));
                    out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact),
                                             _mm256_mul_ps(vsc, _mm256_set1_ps(xs[at])), out[r]);
                }
            }
        }
        for (int r = 0; r < rows; r++)
            _mm256_storeu_ps(y + (m0 + r) * ldy + b * 16 + h * 8, out[r]);
    }
}
#endif

/* The quantized activations of one call (see quantize_rows), and for Q6_K the int sum of each
 * 16 inputs. NULL when memory could not be had. */
typedef struct { int8_t *xq; float *xs, *xsum; int32_t *xsum16; } Scratch;

static int scratch_make(Scratch *s, const float *x, int64_t m_rows, int64_t k, int sums16,
                        int threads) {
    const int64_t groups = k / 32;
    s->xq = malloc((size_t)(m_rows * k));
    s->xs = malloc(sizeof(float) * (size_t)(m_rows * groups));
    s->xsum = malloc(sizeof(float) * (size_t)(m_rows * groups));
    s->xsum16 = sums16 ? malloc(sizeof(int32_t) * (size_t)(m_rows * groups * 2)) : NULL;
    if (!s->xq || !s->xs || !s->xsum || (sums16 && !s->xsum16)) return -1;
    quantize_rows(x, m_rows, k, s->xq, s->xs, s->xsum, s->xsum16, threads);
    return 0;
}

static void scratch_free(Scratch *s) {
    free(s->xq); free(s->xs); free(s->xsum); free(s->xsum16);
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
    for (int64_t b = 0; b < n / 16; b++) {                                                  \
        for (int64_t m0 = 0; m0 < m_rows; m0 += ROWS_PER_PASS) {                            \
            switch (m_rows - m0 < ROWS_PER_PASS ? m_rows - m0 : ROWS_PER_PASS) {            \
                CALL(1) CALL(2) CALL(3) CALL(4) WIDE_ROWS(CALL)                             \
            }                                                                               \
        }                                                                                   \
    }

/* y [m_rows, n] (rows ldy apart) = the quantized x [m_rows, k] of ``s`` times the packed
 * Q4_K or Q6_K weights; k % 32 == 0, n % 16 == 0. */
static void q4k_run(const Scratch *s, int64_t m_rows, int64_t k, const uint8_t *qs,
                    const uint8_t *sc, const uint8_t *mn, const float *d, const float *dmin,
                    int64_t n, float *y, int64_t ldy, int threads) {
#define Q4(R) case R: block_rows(qs, sc, mn, d, dmin, s->xq, s->xs, s->xsum, y, b, m0, R, ldy, k, m_rows); break;
    FOR_BLOCKS(Q4)
#undef Q4
}

static void q6k_run(const Scratch *s, int64_t m_rows, int64_t k, const uint8_t *qs,
                    const uint8_t *qh, const int8_t *sc, const float *d, int64_t n, float *y,
                    int64_t ldy, int threads) {
#define Q6(R) case R: q6_block_rows(qs, qh, sc, d, s->xq, s->xs, s->xsum16, y, b, m0, R, ldy, k, m_rows); break;
    FOR_BLOCKS(Q6)
#undef Q6
}

/* y [m_rows, n] = x [m_rows, k] times the packed weights; k % 32 == 0, n % 16 == 0.
 * Returns 0, or -1 when the scratch memory could not be had. */
int q4k_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs, const uint8_t *sc,
               const uint8_t *mn, const float *d, const float *dmin, int64_t n, float *y,
               int threads) {
    Scratch s;
    int ok = scratch_make(&s, x, m_rows, k, 0, threads) == 0;
    if (ok) q4k_run(&s, m_rows, k, qs, sc, mn, d, dmin, n, y, n, threads);
    scratch_free(&s);
    return ok ? 0 : -1;
}

/* The same for Q6_K weights (layout above). */
int q6k_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs, const uint8_t *qh,
               const int8_t *sc, const float *d, int64_t n, float *y, int threads) {
    Scratch s;
    int ok = scratch_make(&s, x, m_rows, k, 1, threads) == 0;
    if (ok) q6k_run(&s, m_rows, k, qs, qh, sc, d, n, y, n, threads);
    scratch_free(&s);
    return ok ? 0 : -1;
}

/* Attention of n new query rows over a bfloat16 KV cache, one call for all rows and heads.
 *
 * Row j (position start + j) of head h attends over keys 0..start + j of its key-value head
 * h / (heads / kv_heads), and every row is computed by the same code in the same order,
 * whatever n is: so a verify pass gives each token the bits a one-token step gives it (a
 * batched, masked attention sums rows of another length, which rounds differently). The
 * vectors are GCC's 16-float vector type: zmm registers with AVX-512, pairs of ymm with AVX2,
 * the same lane operations and the same fixed reduction trees either way.
 * A task is one row and one key-value head: each block of 16 keys (and of values) is widened
 * to float32 once for the query heads that share it.
 *   q [heads][n][d] float32 (RoPE applied), keys and values [kv_heads][capacity][d] bf16,
 *   out [n][heads][d] float32; d % 32 == 0, d <= MAX_HEAD_DIM, heads / kv_heads <= MAX_SHARED.
 * Returns 0, -1 when memory could not be had, -2 for a shape it does not take. */
#define MAX_HEAD_DIM 256
#define MAX_SHARED 16
typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i32x16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t u32x16 __attribute__((vector_size(64), aligned(4)));

/* 32 bf16 values widened to float32 without a shuffle: the even-numbered ones to dst[0..15],
 * the odd-numbered ones to dst[16..31]. Queries and outputs take the same order. */
static inline void widen32(const uint16_t *src, float *dst) {
    const u32x16 pairs = *(const u32x16 *)src;
    *(f32x16 *)dst = (f32x16)(pairs << 16);
    *(f32x16 *)(dst + 16) = (f32x16)(pairs & 0xFFFF0000u);
}

/* Lane i of the result: the sum of the 16 lanes of v[i], in the tree of sum16 below. */
static inline __attribute__((always_inline)) f32x16 sum16x16(const f32x16 *v) {
    f32x16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  /* lanes 0..7: v[2i] halves added; 8..15: v[2i + 1]'s */
        a[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], (i32x16){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
               __builtin_shuffle(v[2 * i], v[2 * i + 1], (i32x16){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], (i32x16){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
               __builtin_shuffle(a[2 * i], a[2 * i + 1], (i32x16){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], (i32x16){0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
               __builtin_shuffle(b[2 * i], b[2 * i + 1], (i32x16){2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
    return __builtin_shuffle(c[0], c[1], (i32x16){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
           __builtin_shuffle(c[0], c[1], (i32x16){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

static inline float sum16(f32x16 v) {  /* the same tree, one vector */
    float h8[8], h4[4];
    for (int i = 0; i < 8; i++) h8[i] = v[i] + v[i + 8];
    for (int i = 0; i < 4; i++) h4[i] = h8[i] + h8[i + 4];
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

/* exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r), Cephes' polynomial; below
 * -87 it is flushed to 0. */
static inline __attribute__((always_inline)) f32x16 exp16(f32x16 x) {
    const f32x16 magic = (f32x16){} + 12582912.0f;  /* 1.5 * 2^23: rounds to an integer */
    f32x16 low = (f32x16){} - 87.0f;
    i32x16 dead = x < low;
    x = (f32x16)(((i32x16)low & dead) | ((i32x16)x & ~dead));
    f32x16 n = (x * 1.44269504088896341f + magic) - magic;
    f32x16 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    f32x16 p = (f32x16){} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;
    f32x16 y = p * (f32x16)e;
    return (f32x16)((i32x16)y & ~dead);
}

/* Scores of 16 keys (widened in ``wide`` [16][d]) for one query row: 16 accumulators that
 * stay in registers, reduced together. */
static inline __attribute__((always_inline)) f32x16 scores16(const float *qv, const float *wide, int64_t d) {
    f32x16 acc[16];
    for (int t = 0; t < 16; t++) acc[t] = (f32x16){};
    for (int64_t c = 0; c < d; c += 16) {
        const f32x16 qc = *(const f32x16 *)(qv + c);
        for (int t = 0; t < 16; t++) acc[t] += qc * *(const f32x16 *)(wide + t * d + c);
    }
    return sum16x16(acc);
}

int attend_rows(const float *q, const uint16_t *keys, const uint16_t *values, int64_t capacity,
                int64_t start, int64_t n, int64_t heads, int64_t kv_heads, int64_t d,
                float scale, float *out, int threads) {
    const int64_t shared = heads / kv_heads;
    if (d % 32 || d > MAX_HEAD_DIM || heads % kv_heads || shared > MAX_SHARED) return -2;
    const int64_t stride = (start + n + 15) / 16 * 16;  /* one head's scores, padded */
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *p = malloc(sizeof(float) * (size_t)(stride * shared));
        float *wide = malloc(sizeof(float) * (size_t)(16 * d));  /* 16 keys or values */
        float *qs = malloc(sizeof(float) * (size_t)(shared * d));  /* queries, in widen32's order */
        if (!p || !wide || !qs) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * n; task++) {
            if (!p || !wide || !qs) continue;
            const int64_t kv = task / n, j = task % n, len = start + j + 1;
            const uint16_t *kb = keys + kv * capacity * d, *vb = values + kv * capacity * d;
            float *o = out + (j * heads + kv * shared) * d;   /* [shared][d] of this row */
            for (int64_t hh = 0; hh < shared; hh++) {
                const float *qh = q + ((kv * shared + hh) * n + j) * d;
                for (int64_t c = 0; c < d; c += 32)
                    for (int i = 0; i < 16; i++) {
                        qs[hh * d + c + i] = qh[c + 2 * i];
                        qs[hh * d + c + 16 + i] = qh[c + 2 * i + 1];
                    }
            }
            /* scores, 16 keys at a time; a last partial block is padded with zero keys */
            for (int64_t t0 = 0; t0 < len; t0 += 16) {
                for (int64_t t = 0; t < 16; t++)
                    for (int64_t c = 0; c < d; c += 32) {
                        if (t0 + t < len) widen32(kb + (t0 + t) * d + c, wide + t * d + c);
                        else *(f32x16 *)(wide + t * d + c) = *(f32x16 *)(wide + t * d + c + 16) = (f32x16){};
                    }
                for (int64_t hh = 0; hh < shared; hh++)
                    *(f32x16 *)(p + hh * stride + t0) = scores16(qs + hh * d, wide, d) * scale;
            }
            /* softmax weights in place, zero past len; the sums */
            float total[MAX_SHARED];
            for (int64_t hh = 0; hh < shared; hh++) {
                float *ph = p + hh * stride;
                float top = -INFINITY;
                for (int64_t t = 0; t < len; t++) top = ph[t] > top ? ph[t] : top;
                f32x16 sum = {};
                for (int64_t t0 = 0; t0 < len; t0 += 16) {
                    f32x16 e = exp16(*(f32x16 *)(ph + t0) - top);
                    for (int64_t t = len - t0; t < 16; t++) e[t] = 0.0f;
                    *(f32x16 *)(ph + t0) = e;
                    sum += e;
                }
                total[hh] = sum16(sum);
                for (int64_t c = 0; c < d; c += 16) *(f32x16 *)(o + hh * d + c) = (f32x16){};
            }
            /* the weighted values, key by key in order, 16 values widened at a time */
            for (int64_t t0 = 0; t0 < len; t0 += 16) {
                const int64_t block = len - t0 < 16 ? len - t0 : 16;
                for (int64_t t = 0; t < block; t++)
                    for (int64_t c = 0; c < d; c += 32) widen32(vb + (t0 + t) * d + c, wide + t * d + c);
                for (int64_t hh = 0; hh < shared; hh++) {
                    const float *ph = p + hh * stride + t0;
                    for (int64_t c = 0; c < d; c += 16) {
                        f32x16 acc = *(f32x16 *)(o + hh * d + c);
                        for (int64_t t = 0; t < block; t++)
                            acc += ph[t] * *(const f32x16 *)(wide + t * d + c);
                        *(f32x16 *)(o + hh * d + c) = acc;
                    }
                }
            }
            for (int64_t hh = 0; hh < shared; hh++)  /* back to the natural order */
                for (int64_t c = 0; c < d; c += 32) {
                    const f32x16 even = *(f32x16 *)(o + hh * d + c) / total[hh];
                    const f32x16 odd = *(f32x16 *)(o + hh * d + c + 16) / total[hh];
                    for (int i = 0; i < 16; i++) {
                        o[hh * d + c + 2 * i] = even[i];
                        o[hh * d + c + 2 * i + 1] = odd[i];
                    }
                }
        }
        free(p);
        free(wide);
        free(qs);
    }
    return failed ? -1 : 0;
}

/* ------------------------------------------------------------------------------------------
 * The whole decoder stack of a Llama-family model (Qwen2: q/k/v biases) in one call, for a
 * few new tokens: RMSNorm, the Q4_K / Q6_K projections above, RoPE, the bf16 KV cache write,
 * attend_rows, SwiGLU and both residual adds. The same work as the Python loop over layers,
 * without its ~35 tensor calls a layer (about 9 ms of a 1.5B one-token step, 20 ms of a
 * 16-token pass, and a larger share of a 0.5B draft's step). Every step is row by row in a
 * fixed order, so a row's result does not depend on the other rows of the call.
 * ------------------------------------------------------------------------------------------ */
#define MAX_PARTS 4
typedef struct { int64_t kind, n; const void *t[5]; const float *bias; } KPart;  /* kind: 4, 6 */
typedef struct { int64_t parts; KPart part[MAX_PARTS]; } KFused;  /* parts side by side */
typedef struct { const float *norm1, *norm2; KFused qkv, o, gate_up, down; } KLayer;

static int64_t fused_width(const KFused *f) {
    int64_t width = 0;
    for (int64_t i = 0; i < f->parts; i++) width += f->part[i].n;
    return width;
}

/* y [m, width] = x [m, k] times the parts, each with its bias; -1 when memory ran out. */
static int fused_linear(const KFused *f, const float *x, int64_t m, int64_t k, float *y,
                        int threads) {
    const int64_t width = fused_width(f);
    Scratch s;
    int ok = scratch_make(&s, x, m, k, 1, threads) == 0;
    for (int64_t i = 0, at = 0; ok && i < f->parts; at += f->part[i].n, i++) {
        const KPart *p = &f->part[i];
        if (p->kind == 4)
            q4k_run(&s, m, k, p->t[0], p->t[1], p->t[2], p->t[3], p->t[4], p->n, y + at, width,
                    threads);
        else
            q6k_run(&s, m, k, p->t[0], p->t[1], p->t[2], p->t[3], p->n, y + at, width, threads);
        for (int64_t r = 0; p->bias && r < m; r++)
            for (int64_t c = 0; c < p->n; c++) y[r * width + at + c] += p->bias[c];
    }
    scratch_free(&s);
    return ok ? 0 : -1;
}

static void rms_norm(const float *x, const float *w, int64_t m, int64_t k, float eps,
                     float *out) {
    for (int64_t r = 0; r < m; r++) {
        f32x16 acc = {};
        for (int64_t c = 0; c < k; c += 16) {
            const f32x16 v = *(const f32x16 *)(x + r * k + c);
            acc += v * v;
        }
        const float inv = 1.0f / sqrtf(sum16(acc) / (float)k + eps);
        for (int64_t c = 0; c < k; c += 16)
            *(f32x16 *)(out + r * k + c) = *(const f32x16 *)(x + r * k + c) * inv *
                                           *(const f32x16 *)(w + c);
    }
}

static inline uint16_t bf16_round(float f) {  /* round to nearest even, as torch's cast */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* t [d] rotated by RoPE with cos, sin [d] (the halves convention of rotate_half). */
static inline void rope(const float *t, const float *cos, const float *sin, int64_t d,
                        float *out) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++) {
        const float turned = i < half ? -t[i + half] : t[i - half];
        out[i] = t[i] * cos[i] + turned * sin[i];
    }
}

/* a [m, inter] = SiLU(gate) * up from gu [m, 2 * inter]; exp16 takes only x <= 0. */
static void swiglu(const float *gu, int64_t m, int64_t inter, float *a, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m > 1)
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < inter; c += 16) {
            const f32x16 g = *(const f32x16 *)(gu + r * 2 * inter + c);
            const f32x16 u = *(const f32x16 *)(gu + r * 2 * inter + inter + c);
            const i32x16 negative = g < 0.0f;
            const f32x16 e = exp16((f32x16)((i32x16)g | INT32_MIN));  /* exp(-|g|) */
            const f32x16 top = (f32x16)(((i32x16)(g * e) & negative) | ((i32x16)g & ~negative));
            *(f32x16 *)(a + r * inter + c) = top / (1.0f + e) * u;
        }
}

/* x [n, hidden]: the embeddings in, the last layer's output (before the final norm) out.
 * cos, sin [n, d]; keys, values [layers][kv_heads][capacity][d] bf16, positions start.. of
 * every layer written; features [n][count][hidden] (NULL when count is 0) receives the
 * hidden states entering each of the layers in feature_layers. Returns 0, -1 when memory ran
 * out, -2 for a shape attend_rows does not take. */
int lean_forward(const KLayer *layers, int64_t n_layers, float *x, int64_t n, int64_t hidden,
                 int64_t heads, int64_t kv_heads, int64_t d, int64_t inter, float eps,
                 float scale, const float *cos, const float *sin, uint16_t *keys,
                 uint16_t *values, int64_t capacity, int64_t start, float *features,
                 const int64_t *feature_layers, int64_t count, int threads) {
    const int64_t q_size = heads * d, kv_size = kv_heads * d;
    const int64_t qkv_width = q_size + 2 * kv_size;
    if (d % 32 || d > MAX_HEAD_DIM) return -2;  /* attend_rows' limits, checked before RoPE */
    float *h = malloc(sizeof(float) * (size_t)(n * hidden));  /* a norm's or a projection's */
    float *qkv = malloc(sizeof(float) * (size_t)(n * qkv_width));
    float *qrows = malloc(sizeof(float) * (size_t)(n * q_size));
    float *attn = malloc(sizeof(float) * (size_t)(n * q_size));
    float *gu = malloc(sizeof(float) * (size_t)(n * 2 * inter));
    float *a = malloc(sizeof(float) * (size_t)(n * inter));
    float turned[MAX_HEAD_DIM];  /* d <= MAX_HEAD_DIM: attend_rows refuses more */
    int status = h && qkv && qrows && attn && gu && a ? 0 : -1;
    for (int64_t i = 0; status == 0 && i < n_layers; i++) {
        const KLayer *L = &layers[i];
        for (int64_t f = 0; f < count; f++)
            if (feature_layers[f] == i)
                for (int64_t r = 0; r < n; r++)
                    memcpy(features + (r * count + f) * hidden, x + r * hidden,
                           sizeof(float) * (size_t)hidden);
        rms_norm(x, L->norm1, n, hidden, eps, h);
        if ((status = fused_linear(&L->qkv, h, n, hidden, qkv, threads))) break;
        uint16_t *kc = keys + i * kv_heads * capacity * d;
        uint16_t *vc = values + i * kv_heads * capacity * d;
        for (int64_t r = 0; r < n; r++) {
            const float *row = qkv + r * qkv_width;
            for (int64_t hd = 0; hd < heads; hd++)  /* queries as attend_rows takes them */
                rope(row + hd * d, cos + r * d, sin + r * d, d, qrows + (hd * n + r) * d);
            for (int64_t kv = 0; kv < kv_heads; kv++) {
                uint16_t *kslot = kc + (kv * capacity + start + r) * d;
                uint16_t *vslot = vc + (kv * capacity + start + r) * d;
                rope(row + q_size + kv * d, cos + r * d, sin + r * d, d, turned);
                for (int64_t c = 0; c < d; c++) {
                    kslot[c] = bf16_round(turned[c]);
                    vslot[c] = bf16_round(row[q_size + kv_size + kv * d + c]);
                }
            }
        }
        if ((status = attend_rows(qrows, kc, vc, capacity, start, n, heads, kv_heads, d, scale,
                                  attn, threads))) break;
        if ((status = fused_linear(&L->o, attn, n, q_size, h, threads))) break;
        for (int64_t e = 0; e < n * hidden; e++) x[e] += h[e];
        rms_norm(x, L->norm2, n, hidden, eps, h);
        if ((status = fused_linear(&L->gate_up, h, n, hidden, gu, threads))) break;
        swiglu(gu, n, inter, a, threads);
        if ((status = fused_linear(&L->down, a, n, inter, h, threads))) break;
        for (int64_t e = 0; e < n * hidden; e++) x[e] += h[e];
    }
    free(h); free(qkv); free(qrows); free(attn); free(gu); free(a);
    return status;
}
