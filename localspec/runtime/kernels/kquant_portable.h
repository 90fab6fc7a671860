/* The portable inner loops of kquant_matmul.c: plain C11, no intrinsics, the reference the
 * SIMD variants (kquant_avx512.h, kquant_avx2.h) are tested against bit for bit. Integer sums
 * are exact in any order (here: each group's weights unpacked to int16 in input order, then
 * dot products a compiler vectorizes); each float operation is the one the SIMD lanes do, in
 * the same order, fused only where they fuse (fma32, vec16.h). Included by kquant_matmul.c
 * only. */
#include <math.h>

#include "kquant_common.h"
#include "vec16.h"

#define ROWS_PER_PASS 4

/* x rounded to an integer as CVTPS2DQ does it: to nearest even (the default rounding mode),
 * INT32_MIN for NaN and values out of int32's range. */
ALWAYS_INLINE int32_t round_like_cvtps(float x) {
    return x >= -2147483648.0f && x < 2147483648.0f ? (int32_t)rintf(x) : INT32_MIN;
}

/* One group of 32 inputs to int8 with one scale: q = round(x * (127 / amax)) clamped to
 * +-127, amax the largest |x| that is not NaN (0 when there is none: an all-zero group gives
 * zeros). Writes q to dst, the sums of q[0..15] and q[16..31] to sums; returns amax. */
ALWAYS_INLINE float quantize_group(const float *src, int8_t *dst, int32_t sums[2]) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) {
        const float a = fabsf(src[j]);
        amax = a > amax ? a : amax;
    }
    const float inv = group_inverse(amax);
    sums[0] = sums[1] = 0;
    for (int j = 0; j < 32; j++) {
        int32_t q = round_like_cvtps(src[j] * inv);
        q = q < -127 ? -127 : q > 127 ? 127 : q;
        dst[j] = (int8_t)q;
        sums[j / 16] += q;
    }
    return amax;
}

/* Q4_K's (or Q6_K's low) 4 bits of one group's 16 lanes, in input order: w[l][k] for k 0..31
 * (load i holds inputs 8i..8i+3 as low nibbles, 8i+4..8i+7 as high ones, see Q4KGroup). */
ALWAYS_INLINE void unpack_nibbles(const Q4KGroup *group, int16_t w[16][GROUP]) {
    for (int i = 0; i < 4; i++)
        for (int l = 0; l < 16; l++)
            for (int j = 0; j < 4; j++) {
                const int byte = group->load[i][4 * l + j];
                w[l][8 * i + j] = (int16_t)(byte & 15);
                w[l][8 * i + 4 + j] = (int16_t)(byte >> 4);
            }
}

/* sums[l] = the exact int sum of w[l][k] * x[k] over k in from..to-1. */
ALWAYS_INLINE void dot16(int16_t w[16][GROUP], const int8_t *x, int from, int to,
                         int32_t sums[16]) {
    int16_t wide[GROUP];
    for (int k = 0; k < GROUP; k++) wide[k] = x[k];
    for (int l = 0; l < 16; l++) {
        int32_t sum = 0;
        for (int k = from; k < to; k++) sum += w[l][k] * wide[k];
        sums[l] = sum;
    }
}

/* Q5_K's fifth bits (Q5KGroup's top) added to the low 4 of w, at bit 4. */
ALWAYS_INLINE void add_fifth_bits(const uint8_t top[64], int16_t w[16][GROUP]) {
    for (int o = 0; o < 8; o++)
        for (int l = 0; l < 16; l++)
            for (int j = 0; j < 4; j++)
                w[l][4 * o + j] = (int16_t)(w[l][4 * o + j] | (((top[4 * l + j] >> o) & 1) << 4));
}

/* Q3_M's weights (Q3MGroup) of one group's 16 lanes, in input order: the low 2 bits of operand
 * o = 4 i + s at bits 2 s of load i, the third at bit o of top. */
ALWAYS_INLINE void unpack_q3(const Q3MGroup *group, int16_t w[16][GROUP]) {
    for (int o = 0; o < 8; o++)
        for (int l = 0; l < 16; l++)
            for (int j = 0; j < 4; j++) {
                const int low = (group->load[o / 4][4 * l + j] >> (2 * (o % 4))) & 3;
                const int third = (group->top[4 * l + j] >> o) & 1;
                w[l][4 * o + j] = (int16_t)(low | (third << 2));
            }
}

/* Q4_K (bits 4), Q5_K (bits 5, qs holding Q5KGroups) or Q3_M (bits 3, Q3MGroups): rows
 * m0..m0+rows-1 of block b, 16 outputs each. Per group and output lane: the exact int sum of
 * q * xq, then out = fma(sum, d * sc * xs, out) and out = fma(-(dmin * mn), xsum, out). */
ALWAYS_INLINE void block_rows(const uint8_t *qs, const int bits, const uint8_t *sc,
                              const uint8_t *mn, const float *d, const float *dmin,
                              const int8_t *xq, const float *xs, const float *xsum, float *y,
                              int64_t b, int64_t m0, int rows, int64_t ldy, int64_t k,
                              int64_t m_rows) {
    const int64_t groups = k / GROUP, supers = (groups + 7) / 8;
    const size_t stride = bits == 5 ? sizeof(Q5KGroup)
                          : bits == 3 ? sizeof(Q3MGroup) : sizeof(Q4KGroup);
    const uint8_t *wsc = sc + b * groups * 16, *wmn = mn + b * groups * 16;
    float out[ROWS_PER_PASS][16] = {{0.0f}};
    int16_t w[16][GROUP];
    for (int64_t g = 0; g < groups; g++) {
        const float *vd = d + (b * supers + g / 8) * 16, *vdmin = dmin + (b * supers + g / 8) * 16;
        const uint8_t *group = qs + (size_t)(b * groups + g) * stride;
        if (bits == 3) {
            unpack_q3((const Q3MGroup *)group, w);
        } else {
            unpack_nibbles((const Q4KGroup *)group, w);
            if (bits == 5) add_fifth_bits(((const Q5KGroup *)group)->top, w);
        }
        for (int r = 0; r < rows; r++) {
            const int64_t at = g * m_rows + m0 + r;
            int32_t acc[16];
            dot16(w, xq + at * GROUP, 0, GROUP, acc);
            for (int l = 0; l < 16; l++) {
                const float scale = vd[l] * (float)wsc[g * 16 + l];
                const float least = vdmin[l] * (float)wmn[g * 16 + l];
                out[r][l] = fma32((float)acc[l], scale * xs[at], out[r][l]);
                out[r][l] = fma32(-least, xsum[at], out[r][l]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int l = 0; l < 16; l++) y[(m0 + r) * ldy + b * 16 + l] = out[r][l];
}

/* Q8_0 (bits 8: Q8Groups) or Q4_0 (bits 4: Q4KGroups): rows m0..m0+rows-1 of block b. Per
 * group and output lane: the exact int sum of (q - offset) * xq (offset 0 for Q8_0's signed q,
 * 8 for Q4_0), then out = fma(that, d * xs, out). */
ALWAYS_INLINE void q32_block_rows(const uint8_t *qs, const int bits, const float *d,
                                  const int8_t *xq, const float *xs, const int32_t *xsum16,
                                  float *y, int64_t b, int64_t m0, int rows, int64_t ldy,
                                  int64_t k, int64_t m_rows) {
    const int64_t groups = k / GROUP;
    const size_t stride = bits == 8 ? sizeof(Q8Group) : sizeof(Q4KGroup);
    const int32_t offset = bits == 8 ? 0 : 8;
    const float *wd = d + b * groups * 16;
    float out[ROWS_PER_PASS][16] = {{0.0f}};
    int16_t w[16][GROUP];
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = qs + (size_t)(b * groups + g) * stride;
        if (bits == 8) {
            const Q8Group *q8 = (const Q8Group *)group;
            for (int o = 0; o < 8; o++)
                for (int l = 0; l < 16; l++)
                    for (int j = 0; j < 4; j++)
                        w[l][4 * o + j] = (int16_t)(q8->operand[o][4 * l + j] - 128);
        } else {
            unpack_nibbles((const Q4KGroup *)group, w);
        }
        for (int r = 0; r < rows; r++) {
            const int64_t at = g * m_rows + m0 + r;
            const int32_t sum = xsum16[2 * at] + xsum16[2 * at + 1];
            int32_t acc[16];
            dot16(w, xq + at * GROUP, 0, GROUP, acc);
            for (int l = 0; l < 16; l++)
                out[r][l] = fma32((float)(acc[l] - offset * sum), wd[g * 16 + l] * xs[at],
                                  out[r][l]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int l = 0; l < 16; l++) y[(m0 + r) * ldy + b * 16 + l] = out[r][l];
}

/* Q6_K: rows m0..m0+rows-1 of block b. Per half-group t of 16 inputs and output lane: the
 * exact int sum of q * xq minus 32 * sum(xq), then out = fma(that, d * sc * xs, out). */
ALWAYS_INLINE void q6_block_rows(
        const uint8_t *qs, const uint8_t *qh, const int8_t *sc, const float *d,
        const int8_t *xq, const float *xs, const int32_t *xsum16, float *y, int64_t b,
        int64_t m0, int rows, int64_t ldy, int64_t k, int64_t m_rows) {
    const int64_t groups = k / GROUP, supers = (groups + 7) / 8;
    const Q4KGroup *wq = (const Q4KGroup *)qs + b * groups;
    const Q6KTop *wh = (const Q6KTop *)qh + b * groups;
    const int8_t *wsc = sc + b * groups * 32;
    float out[ROWS_PER_PASS][16] = {{0.0f}};
    int16_t w[16][GROUP];
    for (int64_t g = 0; g < groups; g++) {
        const float *vd = d + (b * supers + g / 8) * 16;
        unpack_nibbles(&wq[g], w);
        for (int i = 0; i < 4; i++)  /* the top 2 bits of each operand (see Q6KTop) */
            for (int l = 0; l < 16; l++)
                for (int j = 0; j < 4; j++) {
                    const int top = wh[g].vector[i / 2][4 * l + j] >> (4 * (i % 2));
                    w[l][8 * i + j] = (int16_t)(w[l][8 * i + j] | ((top & 3) << 4));
                    w[l][8 * i + 4 + j] = (int16_t)(w[l][8 * i + 4 + j] | (((top >> 2) & 3) << 4));
                }
        for (int r = 0; r < rows; r++) {
            const int64_t at = g * m_rows + m0 + r;
            for (int t = 0; t < 2; t++) {
                int32_t acc[16];
                dot16(w, xq + at * GROUP, 16 * t, 16 * t + 16, acc);
                for (int l = 0; l < 16; l++) {
                    const float scale = vd[l] * (float)wsc[(2 * g + t) * 16 + l];
                    const int32_t exact = acc[l] - 32 * xsum16[2 * at + t];
                    out[r][l] = fma32((float)exact, scale * xs[at], out[r][l]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int l = 0; l < 16; l++) y[(m0 + r) * ldy + b * 16 + l] = out[r][l];
}
