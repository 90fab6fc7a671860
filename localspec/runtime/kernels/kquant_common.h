/* What the per-variant inner loops of kquant_matmul.c (kquant_avx512.h, kquant_avx2.h,
 * kquant_portable.h) share, kept here so that each of them includes what it uses rather
 * than relying on the file that includes it. */
#ifndef LOCALSPEC_KQUANT_COMMON_H
#define LOCALSPEC_KQUANT_COMMON_H

#include "kernels.h"

#ifndef PREFETCH
#define PREFETCH 8  /* groups ahead */
#endif

/* 127 / amax: what a group's inputs are multiplied by before rounding (0 for an all-zero or
 * all-NaN group, whose inputs all become 0 or -127). */
ALWAYS_INLINE float group_inverse(float amax) { return amax > 0.0f ? 127.0f / amax : 0.0f; }

#endif
