/* The AVX-512 VNNI inner loops of kquant_matmul.c: each group's products are exact int32 sums
 * (VPDPBUSD: u8 weights times s8 inputs), scaled per lane exactly as kquant_portable.h does.
 * Included by kquant_matmul.c only. */
#include <immintrin.h>
#include <string.h>

#include "kquant_common.h"

#define ROWS_PER_PASS 8

/* One group of 32 inputs to int8 (see kquant_portable.h); returns amax. */
ALWAYS_INLINE float quantize_group(const float *src, int8_t *dst, int32_t sums[2]) {
    const __m512 v0 = _mm512_loadu_ps(src), v1 = _mm512_loadu_ps(src + 16);
    /* a maximum is exact in any order; max(|x|, m) keeps m for a NaN x */
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(
        _mm512_abs_ps(v1), _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps())));
    const __m512 inv = _mm512_set1_ps(group_inverse(amax));
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    /* CVTPS2DQ: nearest even, NaN and out of range INT32_MIN (then clamped) */
    const __m512i q0 = _mm512_min_epi32(_mm512_max_epi32(
        _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), lo), hi);
    const __m512i q1 = _mm512_min_epi32(_mm512_max_epi32(
        _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)), lo), hi);
    _mm_storeu_si128((__m128i *)dst, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(dst + 16), _mm512_cvtepi32_epi8(q1));
    sums[0] = _mm512_reduce_add_epi32(q0);
    sums[1] = _mm512_reduce_add_epi32(q1);
    return amax;
}

/* acc[r] += w's 16 outputs dotted with the 4 int8 inputs at x + 32 r, for each of ``rows``
 * rows (an operand's inputs for consecutive rows of the quantized activations lie 32 apart). */
ALWAYS_INLINE void dot_rows(__m512i *acc, __m512i w, const int8_t *x, int rows) {
    for (int r = 0; r < rows; r++) {
        int32_t a;
        memcpy(&a, x + 32 * r, 4);
        acc[r] = _mm512_dpbusd_epi32(acc[r], w, _mm512_set1_epi32(a));
    }
}

/* ``dot_rows`` of two operands whose inputs lie 4 apart (the low and high nibbles of one load),
 * both in each row's turn. */
ALWAYS_INLINE void dot_rows2(__m512i *acc, __m512i w0, __m512i w1, const int8_t *x, int rows) {
    for (int r = 0; r < rows; r++) {
        int32_t a0, a1;
        memcpy(&a0, x + 32 * r, 4);
        memcpy(&a1, x + 32 * r + 4, 4);
        acc[r] = _mm512_dpbusd_epi32(acc[r], w0, _mm512_set1_epi32(a0));
        acc[r] = _mm512_dpbusd_epi32(acc[r], w1, _mm512_set1_epi32(a1));
    }
}

/* Q5_K's fifth bit of operand o (bit o of each top byte) moved to bit 4. */
#define Q5_TOP(hv, o) ((o) < 4 ? _mm512_slli_epi16(hv, 4 - (o)) : \
                       (o) == 4 ? (hv) : _mm512_srli_epi16(hv, (o) - 4))

/* Q3_M's operand o: the low 2 bits (bits 2 s of load v, o = 4 i + s) and the third (bit o of
 * each top byte) moved to bit 2. */
ALWAYS_INLINE __m512i q3_operand(__m512i v, __m512i hv, int o) {
    const __m512i t = o < 2 ? _mm512_slli_epi16(hv, 2 - o) : o == 2 ? hv
                            : _mm512_srli_epi16(hv, o - 2);
    return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 2 * (o % 4)),
                                            _mm512_set1_epi8(3)),
                           _mm512_and_si512(t, _mm512_set1_epi8(4)));
}

/* Q4_K (bits 4), Q5_K (bits 5, qs holding Q5KGroups) or Q3_M (bits 3, Q3MGroups): rows
 * m0..m0+rows-1 of block b, 16 outputs each. Always inlined with constant ``rows`` and
 * ``bits``, so that the accumulators live in registers and Q4_K's loop has no trace of the
 * others' bits. */
ALWAYS_INLINE void block_rows(const uint8_t *qs, const int bits, const uint8_t *sc,
                              const uint8_t *mn, const float *d, const float *dmin,
                              const int8_t *xq, const float *xs, const float *xsum, float *y,
                              int64_t b, int64_t m0, int rows, int64_t ldy, int64_t k,
                              int64_t m_rows) {
    const int64_t groups = k / GROUP, supers = (groups + 7) / 8;
    const size_t stride = bits == 5 ? sizeof(Q5KGroup)
                          : bits == 3 ? sizeof(Q3MGroup) : sizeof(Q4KGroup);
    const __m512i low = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    __m512 out[ROWS_PER_PASS];
    for (int r = 0; r < rows; r++) out[r] = _mm512_setzero_ps();
    const uint8_t *wsc = sc + b * groups * 16;
    const uint8_t *wmn = mn + b * groups * 16;
    __m512 vd = _mm512_setzero_ps(), vdmin = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if ((g & 7) == 0) {
            vd = _mm512_loadu_ps(d + (b * supers + g / 8) * 16);
            vdmin = _mm512_loadu_ps(dmin + (b * supers + g / 8) * 16);
        }
        const uint8_t *group = qs + (size_t)(b * groups + g) * stride;
        __m512i acc[ROWS_PER_PASS];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_si512();
        for (size_t p = 0; p < stride; p += 64)
            _mm_prefetch((const char *)group + PREFETCH * stride + p, _MM_HINT_T0);
        if (bits == 3) {
            const Q3MGroup *g3 = (const Q3MGroup *)group;
            const __m512i hv = _mm512_loadu_si512((const void *)g3->top);
            for (int o = 0; o < 8; o++) {
                const __m512i w = q3_operand(
                    _mm512_loadu_si512((const void *)g3->load[o / 4]), hv, o);
                dot_rows(acc, w, xq + (g * m_rows + m0) * 32 + 4 * o, rows);
            }
        } else {
            const __m512i hv = bits == 5
                ? _mm512_loadu_si512((const void *)((const Q5KGroup *)group)->top)
                : _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                __m512i v = _mm512_loadu_si512((const void *)((const Q4KGroup *)group)->load[i]);
                __m512i w0 = _mm512_and_si512(v, low);
                __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                if (bits == 5) {
                    w0 = _mm512_or_si512(w0, _mm512_and_si512(Q5_TOP(hv, 2 * i), bit4));
                    w1 = _mm512_or_si512(w1, _mm512_and_si512(Q5_TOP(hv, 2 * i + 1), bit4));
                }
                dot_rows2(acc, w0, w1, xq + (g * m_rows + m0) * 32 + 8 * i, rows);
            }
        }
        __m512 vsc = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(wsc + g * 16)))));
        __m512 vmn = _mm512_mul_ps(vdmin, _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(wmn + g * 16)))));
        for (int r = 0; r < rows; r++) {
            int64_t at = g * m_rows + m0 + r;
            __m512 s = _mm512_mul_ps(vsc, _mm512_set1_ps(xs[at]));
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), s, out[r]);
            out[r] = _mm512_fnmadd_ps(vmn, _mm512_set1_ps(xsum[at]), out[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + (m0 + r) * ldy + b * 16, out[r]);
}

/* Q8_0 (bits 8: Q8Groups of q + 128) or Q4_0 (bits 4: Q4KGroups of q): per group, the int32
 * sum of the stored u8 times x minus offset (128 or 8) times sum(x) is exact; it is scaled
 * once by d * xs (see kquant_portable.h). */
ALWAYS_INLINE void q32_block_rows(const uint8_t *qs, const int bits, const float *d,
                                  const int8_t *xq, const float *xs, const int32_t *xsum16,
                                  float *y, int64_t b, int64_t m0, int rows, int64_t ldy,
                                  int64_t k, int64_t m_rows) {
    const int64_t groups = k / GROUP;
    const size_t stride = bits == 8 ? sizeof(Q8Group) : sizeof(Q4KGroup);
    const int32_t offset = bits == 8 ? 128 : 8;
    const __m512i low = _mm512_set1_epi8(0x0F);
    const float *wd = d + b * groups * 16;
    __m512 out[ROWS_PER_PASS];
    for (int r = 0; r < rows; r++) out[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = qs + (size_t)(b * groups + g) * stride;
        for (size_t p = 0; p < stride; p += 64)
            _mm_prefetch((const char *)group + PREFETCH * stride + p, _MM_HINT_T0);
        __m512i acc[ROWS_PER_PASS];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_si512();
        for (int o = 0; o < 8; o++) {
            __m512i w;
            if (bits == 8) {
                w = _mm512_loadu_si512((const void *)(group + 64 * o));
            } else {
                const __m512i v = _mm512_loadu_si512((const void *)(group + 64 * (o / 2)));
                w = _mm512_and_si512(o % 2 ? _mm512_srli_epi16(v, 4) : v, low);
            }
            dot_rows(acc, w, xq + (g * m_rows + m0) * 32 + 4 * o, rows);
        }
        const __m512 vd = _mm512_loadu_ps(wd + g * 16);
        for (int r = 0; r < rows; r++) {
            const int64_t at = g * m_rows + m0 + r;
            const int32_t sum = xsum16[2 * at] + xsum16[2 * at + 1];
            const __m512i exact = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(offset * sum));
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact),
                                     _mm512_mul_ps(vd, _mm512_set1_ps(xs[at])), out[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + (m0 + r) * ldy + b * 16, out[r]);
}

/* Q6_K operand s of load i (ii = i % 2): the top bits moved to bits 4..5 of each byte. */
#define Q6_TOP(hv, sh) ((sh) < 4 ? _mm512_slli_epi16(hv, 4 - (sh)) : \
                        (sh) == 4 ? (hv) : _mm512_srli_epi16(hv, (sh) - 4))

/* Q6_K: per half-group of 16 inputs the int32 sum of q * x minus 32 * sum(x) is exact; it is
 * scaled once, in the same order for any M. */
ALWAYS_INLINE void q6_block_rows(
        const uint8_t *qs, const uint8_t *qh, const int8_t *sc, const float *d,
        const int8_t *xq, const float *xs, const int32_t *xsum16, float *y, int64_t b,
        int64_t m0, int rows, int64_t ldy, int64_t k, int64_t m_rows) {
    const int64_t groups = k / GROUP, supers = (groups + 7) / 8;
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    __m512 out[ROWS_PER_PASS];
    for (int r = 0; r < rows; r++) out[r] = _mm512_setzero_ps();
    const Q4KGroup *wq = (const Q4KGroup *)qs + b * groups;
    const Q6KTop *wh = (const Q6KTop *)qh + b * groups;
    const int8_t *wsc = sc + b * groups * 32;
    __m512 vd = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if ((g & 7) == 0) vd = _mm512_loadu_ps(d + (b * supers + g / 8) * 16);
        for (int i = 0; i < 4; i++)
            _mm_prefetch((const char *)wq[g + PREFETCH].load[i], _MM_HINT_T0);
        for (int t = 0; t < 2; t++)
            _mm_prefetch((const char *)wh[g + PREFETCH].vector[t], _MM_HINT_T0);
        for (int t = 0; t < 2; t++) {
            const __m512i hv = _mm512_loadu_si512((const void *)wh[g].vector[t]);
            __m512i acc[ROWS_PER_PASS];
            for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_si512();
            for (int ii = 0; ii < 2; ii++) {
                const int i = 2 * t + ii;
                __m512i v = _mm512_loadu_si512((const void *)wq[g].load[i]);
                __m512i w0 = _mm512_or_si512(_mm512_and_si512(v, low),
                                             _mm512_and_si512(Q6_TOP(hv, 4 * ii), top));
                __m512i w1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                             _mm512_and_si512(Q6_TOP(hv, 4 * ii + 2), top));
                dot_rows2(acc, w0, w1, xq + (g * m_rows + m0) * 32 + 8 * i, rows);
            }
            __m512 vsc = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const void *)(wsc + (2 * g + t) * 16)))));
            for (int r = 0; r < rows; r++) {
                int64_t at = g * m_rows + m0 + r;
                __m512i exact = _mm512_sub_epi32(acc[r],
                                                 _mm512_set1_epi32(32 * xsum16[2 * at + t]));
                out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact),
                                         _mm512_mul_ps(vsc, _mm512_set1_ps(xs[at])), out[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + (m0 + r) * ldy + b * 16, out[r]);
}
