/* One core's VPDPBUSD throughput, alone and in the instruction mixes of the native kernels'
 * wide rows (docs/research-log.md, "What bounds the last goals"): how far a pass over many rows,
 * bound by arithmetic, is from the VNNI peak, and which of its operations hold it there.
 *
 *   gcc -O2 -mavx512f -mavx512vnni scripts/vnni_mix.c -o /tmp/vnni_mix && /tmp/vnni_mix
 *
 * x86-64 with AVX-512 VNNI only. Each loop body is independent instructions on registers (no
 * memory, no dependency chains longer than the loop), so it measures issue throughput. */
#include <stdio.h>
#include <time.h>

#define ITERATIONS 50000000L
#define DP(r) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #r "\n"

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void report(const char *mix, int per_iteration, double elapsed, double peak) {
    double rate = per_iteration * ITERATIONS / elapsed / 1e9;
    printf("%-62s %5.2f G VPDPBUSD/s  %3.0f%%\n", mix, rate, peak > 0 ? 100 * rate / peak : 100.0);
}

int main(void) {
    double start = seconds();
    for (long n = 0; n < ITERATIONS; n++)
        __asm__ volatile(DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7) DP(8) DP(9) DP(10) DP(11)
                         ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",
                             "xmm8", "xmm9", "xmm10", "xmm11");
    double elapsed = seconds() - start, peak = 12 * ITERATIONS / elapsed / 1e9;
    report("VPDPBUSD alone", 12, elapsed, 0);

    start = seconds();
    for (long n = 0; n < ITERATIONS; n++)
        __asm__ volatile(DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7)
                         "vcvtdq2ps %%zmm30, %%zmm9\n"
                         ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",
                             "xmm9");
    report("8 VPDPBUSD + conversion to float", 8, seconds() - start, peak);

    start = seconds();
    for (long n = 0; n < ITERATIONS; n++)
        __asm__ volatile(DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7)
                         "vcvtdq2ps %%zmm30, %%zmm8\n"
                         "vmulps %%zmm30, %%zmm31, %%zmm9\n"
                         "vfmadd231ps %%zmm30, %%zmm31, %%zmm10\n"
                         "vfnmadd231ps %%zmm30, %%zmm31, %%zmm11\n"
                         ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",
                             "xmm8", "xmm9", "xmm10", "xmm11");
    report("Q4_K group, one row: 8 VPDPBUSD + cvt, mul, FMA, FNMA", 8, seconds() - start, peak);

    start = seconds();
    for (long n = 0; n < ITERATIONS; n++)
        __asm__ volatile(DP(0) DP(1) DP(2) DP(3)
                         "vpsubd %%zmm30, %%zmm31, %%zmm8\n"
                         "vcvtdq2ps %%zmm30, %%zmm9\n"
                         "vmulps %%zmm30, %%zmm31, %%zmm10\n"
                         "vfmadd231ps %%zmm30, %%zmm31, %%zmm11\n"
                         ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm8", "xmm9", "xmm10", "xmm11");
    report("Q6_K half-group, one row: 4 VPDPBUSD + sub, cvt, mul, FMA", 4, seconds() - start,
           peak);
    return 0;
}
