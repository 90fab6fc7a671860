/* The AVX2 inner loops of kquant_matmul.c (CPUs without AVX-512 VNNI): the same integer sums,
 * made with VPMADDUBSW (u8 x s8 pairs, at most 2 * 63 * 127: no saturation) and VPMADDWD,
 * and the same float operations on each lane as kquant_portable.h. A 16-row block is taken in
 * two halves of 8 rows (bytes 0..31 and 32..63 of each 64-byte load). Included by
 * kquant_matmul.c only. */
#include <immintrin.h>
#include <string.h>

#include "kquant_common.h"

#define ROWS_PER_PASS 4

/* One group of 32 inputs to int8 (see kquant_portable.h); returns amax. */
ALWAYS_INLINE float quantize_group(const float *src, int8_t *dst, int32_t sums[2]) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(src + 8 * i);
        top = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), top);  /* a NaN keeps top */
    }
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    const __m256 inv = _mm256_set1_ps(group_inverse(amax));
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    int32_t q[32];
    for (int i = 0; i < 4; i++)
        _mm256_storeu_si256((__m256i *)(q + 8 * i), _mm256_min_epi32(_mm256_max_epi32(
            _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), lo), hi));
    sums[0] = sums[1] = 0;
    for (int j = 0; j < 32; j++) {
        dst[j] = (int8_t)q[j];
        sums[j / 16] += q[j];
    }
    return amax;
}

ALWAYS_INLINE __m256i broadcast4(const int8_t *a) {
    int32_t word;
    memcpy(&word, a, 4);
    return _mm256_set1_epi32(word);
}

#define Q5_TOP(hv, o) ((o) < 4 ? _mm256_slli_epi16(hv, 4 - (o)) : \
                       (o) == 4 ? (hv) : _mm256_srli_epi16(hv, (o) - 4))

/* acc[r] += w's 8 outputs dotted with the 4 int8 inputs at x + 32 r, for each of ``rows`` rows
 * (an operand's inputs for consecutive rows of the quantized activations lie 32 apart). */
ALWAYS_INLINE void dot_rows(__m256i *acc, __m256i w, const int8_t *x, int rows) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rows; r++)
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(
            _mm256_maddubs_epi16(w, broadcast4(x + 32 * r)), ones));
}

/* ``dot_rows`` of two operands whose inputs lie 4 apart (the low and high nibbles of one load),
 * both in each row's turn. */
ALWAYS_INLINE void dot_rows2(__m256i *acc, __m256i w0, __m256i w1, const int8_t *x, int rows) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rows; r++) {
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(
            _mm256_maddubs_epi16(w0, broadcast4(x + 32 * r)), ones));
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(
            _mm256_maddubs_epi16(w1, broadcast4(x + 32 * r + 4)), ones));
    }
}

/* Q3_M's operand o (see kquant_avx512.h). */
ALWAYS_INLINE __m256i q3_operand(__m256i v, __m256i hv, int o) {
    const __m256i t = o < 2 ? _mm256_slli_epi16(hv, 2 - o) : o == 2 ? hv
                            : _mm256_srli_epi16(hv, o - 2);
    return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 2 * (o % 4)),
                                            _mm256_set1_epi8(3)),
                           _mm256_and_si256(t, _mm256_set1_epi8(4)));
}

/* Q4_K (bits 4), Q5_K (bits 5) or Q3_M (bits 3): rows m0..m0+rows-1 of block b, 16 outputs
 * each (see kquant_avx512.h). */
ALWAYS_INLINE void block_rows(const uint8_t *qs, const int bits, const uint8_t *sc,
                              const uint8_t *mn, const float *d, const float *dmin,
                              const int8_t *xq, const float *xs, const float *xsum, float *y,
                              int64_t b, int64_t m0, int rows, int64_t ldy, int64_t k,
                              int64_t m_rows) {
    const int64_t groups = k / GROUP, supers = (groups + 7) / 8;
    const size_t stride = bits == 5 ? sizeof(Q5KGroup)
                          : bits == 3 ? sizeof(Q3MGroup) : sizeof(Q4KGroup);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    for (int h = 0; h < 2; h++) {
        __m256 out[ROWS_PER_PASS];
        for (int r = 0; r < rows; r++) out[r] = _mm256_setzero_ps();
        const uint8_t *wsc = sc + b * groups * 16 + h * 8;
        const uint8_t *wmn = mn + b * groups * 16 + h * 8;
        __m256 vd = _mm256_setzero_ps(), vdmin = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            if ((g & 7) == 0) {
                vd = _mm256_loadu_ps(d + (b * supers + g / 8) * 16 + h * 8);
                vdmin = _mm256_loadu_ps(dmin + (b * supers + g / 8) * 16 + h * 8);
            }
            const uint8_t *group = qs + (size_t)(b * groups + g) * stride;
            __m256i acc[ROWS_PER_PASS];
            for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_si256();
            for (size_t p = 0; p < stride; p += 64)
                _mm_prefetch((const char *)group + PREFETCH * stride + p, _MM_HINT_T0);
            if (bits == 3) {
                const Q3MGroup *g3 = (const Q3MGroup *)group;
                const __m256i hv = _mm256_loadu_si256((const void *)(g3->top + h * 32));
                for (int o = 0; o < 8; o++) {
                    const __m256i w = q3_operand(
                        _mm256_loadu_si256((const void *)(g3->load[o / 4] + h * 32)), hv, o);
                    dot_rows(acc, w, xq + (g * m_rows + m0) * 32 + 4 * o, rows);
                }
            } else {
                const __m256i hv = bits == 5
                    ? _mm256_loadu_si256((const void *)(((const Q5KGroup *)group)->top + h * 32))
                    : _mm256_setzero_si256();
                for (int i = 0; i < 4; i++) {
                    __m256i v = _mm256_loadu_si256(
                        (const void *)(((const Q4KGroup *)group)->load[i] + h * 32));
                    __m256i w0 = _mm256_and_si256(v, low);
                    __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    if (bits == 5) {
                        w0 = _mm256_or_si256(w0, _mm256_and_si256(Q5_TOP(hv, 2 * i), bit4));
                        w1 = _mm256_or_si256(w1, _mm256_and_si256(Q5_TOP(hv, 2 * i + 1), bit4));
                    }
                    dot_rows2(acc, w0, w1, xq + (g * m_rows + m0) * 32 + 8 * i, rows);
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

/* Q8_0 (bits 8) or Q4_0 (bits 4): see kquant_avx512.h. VPMADDUBSW would saturate on Q8_0's
 * u8 q + 128 (2 * 255 * 127), so Q8_0 multiplies the signed q as |q| times x with q's sign
 * (at most 2 * 128 * 127): the same exact sums, with offset 0. */
ALWAYS_INLINE void q32_block_rows(const uint8_t *qs, const int bits, const float *d,
                                  const int8_t *xq, const float *xs, const int32_t *xsum16,
                                  float *y, int64_t b, int64_t m0, int rows, int64_t ldy,
                                  int64_t k, int64_t m_rows) {
    const int64_t groups = k / GROUP;
    const size_t stride = bits == 8 ? sizeof(Q8Group) : sizeof(Q4KGroup);
    const int32_t offset = bits == 8 ? 0 : 8;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int h = 0; h < 2; h++) {
        const float *wd = d + b * groups * 16 + h * 8;
        __m256 out[ROWS_PER_PASS];
        for (int r = 0; r < rows; r++) out[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *group = qs + (size_t)(b * groups + g) * stride;
            for (size_t p = 0; p < stride; p += 64)
                _mm_prefetch((const char *)group + PREFETCH * stride + p, _MM_HINT_T0);
            __m256i acc[ROWS_PER_PASS];
            for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_si256();
            for (int o = 0; o < 8; o++) {
                __m256i w, q = _mm256_setzero_si256();
                if (bits == 8) {
                    q = _mm256_xor_si256(
                        _mm256_loadu_si256((const void *)(group + 64 * o + h * 32)), flip);
                    w = _mm256_abs_epi8(q);
                } else {
                    const __m256i v = _mm256_loadu_si256(
                        (const void *)(group + 64 * (o / 2) + h * 32));
                    w = _mm256_and_si256(o % 2 ? _mm256_srli_epi16(v, 4) : v, low);
                }
                for (int r = 0; r < rows; r++) {
                    __m256i a = broadcast4(xq + (g * m_rows + m0 + r) * 32 + 4 * o);
                    if (bits == 8) a = _mm256_sign_epi8(a, q);
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(w, a), ones));
                }
            }
            const __m256 vd = _mm256_loadu_ps(wd + g * 16);
            for (int r = 0; r < rows; r++) {
                const int64_t at = g * m_rows + m0 + r;
                const int32_t sum = xsum16[2 * at] + xsum16[2 * at + 1];
                const __m256i exact = _mm256_sub_epi32(acc[r], _mm256_set1_epi32(offset * sum));
                out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact),
                                         _mm256_mul_ps(vd, _mm256_set1_ps(xs[at])), out[r]);
            }
        }
        for (int r = 0; r < rows; r++)
            _mm256_storeu_ps(y + (m0 + r) * ldy + b * 16 + h * 8, out[r]);
    }
}

#define Q6_TOP(hv, sh) ((sh) < 4 ? _mm256_slli_epi16(hv, 4 - (sh)) : \
                        (sh) == 4 ? (hv) : _mm256_srli_epi16(hv, (sh) - 4))

/* Q6_K: rows m0..m0+rows-1 of block b (see kquant_avx512.h). */
ALWAYS_INLINE void q6_block_rows(
        const uint8_t *qs, const uint8_t *qh, const int8_t *sc, const float *d,
        const int8_t *xq, const float *xs, const int32_t *xsum16, float *y, int64_t b,
        int64_t m0, int rows, int64_t ldy, int64_t k, int64_t m_rows) {
    const int64_t groups = k / GROUP, supers = (groups + 7) / 8;
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const Q4KGroup *wq = (const Q4KGroup *)qs + b * groups;
    const Q6KTop *wh = (const Q6KTop *)qh + b * groups;
    for (int h = 0; h < 2; h++) {
        __m256 out[ROWS_PER_PASS];
        for (int r = 0; r < rows; r++) out[r] = _mm256_setzero_ps();
        const int8_t *wsc = sc + b * groups * 32 + h * 8;
        __m256 vd = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            if ((g & 7) == 0) vd = _mm256_loadu_ps(d + (b * supers + g / 8) * 16 + h * 8);
            for (int t = 0; t < 2; t++) {
                _mm_prefetch((const char *)wq[g + PREFETCH].load[2 * t], _MM_HINT_T0);
                _mm_prefetch((const char *)wq[g + PREFETCH].load[2 * t + 1], _MM_HINT_T0);
                _mm_prefetch((const char *)wh[g + PREFETCH].vector[t], _MM_HINT_T0);
                const __m256i hv = _mm256_loadu_si256((const void *)(wh[g].vector[t] + h * 32));
                __m256i acc[ROWS_PER_PASS];
                for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_si256();
                for (int ii = 0; ii < 2; ii++) {
                    const int i = 2 * t + ii;
                    __m256i v = _mm256_loadu_si256((const void *)(wq[g].load[i] + h * 32));
                    __m256i w0 = _mm256_or_si256(_mm256_and_si256(v, low),
                                                 _mm256_and_si256(Q6_TOP(hv, 4 * ii), top));
                    __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                                 _mm256_and_si256(Q6_TOP(hv, 4 * ii + 2), top));
                    dot_rows2(acc, w0, w1, xq + (g * m_rows + m0) * 32 + 8 * i, rows);
                }
                __m256 vsc = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const void *)(wsc + (2 * g + t) * 16)))));
                for (int r = 0; r < rows; r++) {
                    int64_t at = g * m_rows + m0 + r;
                    __m256i exact = _mm256_sub_epi32(
                        acc[r], _mm256_set1_epi32(32 * xsum16[2 * at + t]));
                    out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact),
                                             _mm256_mul_ps(vsc, _mm256_set1_ps(xs[at])), out[r]);
                }
            }
        }
        for (int r = 0; r < rows; r++)
            _mm256_storeu_ps(y + (m0 + r) * ldy + b * 16 + h * 8, out[r]);
    }
}
