/* y = x W^T for 4-bit or 8-bit weights and fp32 rows, on AVX2 with FMA: the kernel for CPUs without
 * AVX-512 BF16 (and for fp32 models on those with it). The weights stream from memory in their
 * small form and are widened to fp32 in registers: w = fma(q, scale, shift) for 4-bit (shift =
 * zero - 8 scale, precomputed), w = q for 8-bit (its per-column scale multiplies the sum).
 * Each output is one fma chain over k in order, whatever the row count or tile, so a row computes
 * bit-identically alone or in a batch.
 *
 * Few rows (memory-bound): tiles of 1-2 rows over 2-4 column blocks widen the weights in registers.
 * From STRIP_ROWS rows each 16-column block is widened once into a per-thread strip of fp32 [K][16]
 * (L1/L2-resident), which tiles of up to 6 rows then read: the widening is paid once, not per row.
 *
 * Layouts (built by engine/cpu_kernels.py's int4_pack / int8_pack for float32), N % 16 == 0:
 *   4-bit packed [N/16][K][8] bytes: byte c of (block b, k) holds q[16b + c, k] in its low nibble
 *         and q[16b + 8 + c, k] in its high one; scales [N/16][G][2][16] fp32: per block and group
 *         16 scales, then 16 shifts.
 *   8-bit packed [N/16][K][16] int8: byte c of (block b, k) is q[16b + c, k]; scales [N] fp32.
 *   x [M, K] fp32 contiguous, y [M, N] fp32.
 * Return 0, -1 where this CPU lacks AVX2 or FMA (the caller then uses torch), -2 out of memory.
 */
#include <stdint.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"
#include "pool.h"

#ifdef PC_AVX2_FMA
#include <immintrin.h>

#define STRIP_ROWS 3

struct job {
    const uint8_t *packed;
    const float *scales, *x;
    float *y;
    int M, K, group, N, bits, failed;
};

/* Block b's 16 weights at input k as two vectors of 8 columns; s: the block's scales and shifts
 * for k's group (4-bit). */
ALWAYS_INLINE void widen(const struct job *j, int64_t b, int k, const float *s, const int BITS, __m256 *lo,
                         __m256 *hi) {
    if (BITS == 4) {
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(j->packed + (b * j->K + k) * 8)));
        const __m256i mask = _mm256_set1_epi32(15);
        *lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, mask)), _mm256_loadu_ps(s),
                              _mm256_loadu_ps(s + 16));
        *hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), _mm256_loadu_ps(s + 8),
                              _mm256_loadu_ps(s + 24));
    } else {
        const __m128i q = _mm_loadu_si128((const __m128i *)(j->packed + (b * j->K + k) * 16));
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
    }
}

/* Block b's scales and shifts for group g (4-bit; 8-bit weights have none). */
ALWAYS_INLINE const float *group_scales(const struct job *j, int64_t b, int g) {
    return j->scales + ((b * (j->K / j->group) + g) * 2) * 16;
}

/* acc (the 16 sums of row m, block b) to y, times the 8-bit per-column scales. */
ALWAYS_INLINE void store(const struct job *j, int m, int64_t b, __m256 lo, __m256 hi, const int BITS) {
    float *out = j->y + (int64_t)m * j->N + b * 16;
    if (BITS == 8) {
        lo = _mm256_mul_ps(lo, _mm256_loadu_ps(j->scales + b * 16));
        hi = _mm256_mul_ps(hi, _mm256_loadu_ps(j->scales + b * 16 + 8));
    }
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
}

/* The accumulator arrays have fixed sizes (a VLA of MR would live on the stack): the compiler keeps
 * the MR x NB used ones in registers. */

/* MR rows by NB blocks, the weights widened in registers at each k. */
ALWAYS_INLINE void direct_tile(const struct job *j, int m0, int64_t b0, const int MR, const int NB, const int BITS) {
    const int K = j->K;
    const float *x = j->x + (int64_t)m0 * K;
    __m256 acc[2][4][2];
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_ps();
    for (int g = 0; g < K / j->group; g++)
        for (int k = g * j->group; k < (g + 1) * j->group; k++)
            for (int b = 0; b < NB; b++) {
                __m256 lo, hi;
                widen(j, b0 + b, k, group_scales(j, b0 + b, g), BITS, &lo, &hi);
                for (int m = 0; m < MR; m++) {
                    const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
                    acc[m][b][0] = _mm256_fmadd_ps(xv, lo, acc[m][b][0]);
                    acc[m][b][1] = _mm256_fmadd_ps(xv, hi, acc[m][b][1]);
                }
            }
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++) store(j, m0 + m, b0 + b, acc[m][b][0], acc[m][b][1], BITS);
}

/* MR rows of one block from its widened strip [K][16]. */
ALWAYS_INLINE void strip_tile(const struct job *j, const float *strip, int m0, int64_t b, const int MR,
                              const int BITS) {
    const int K = j->K;
    const float *x = j->x + (int64_t)m0 * K;
    __m256 acc[6][2];
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        const __m256 lo = _mm256_load_ps(strip + k * 16), hi = _mm256_load_ps(strip + k * 16 + 8);
        for (int m = 0; m < MR; m++) {
            const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
            acc[m][0] = _mm256_fmadd_ps(xv, lo, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xv, hi, acc[m][1]);
        }
    }
    for (int m = 0; m < MR; m++) store(j, m0 + m, b, acc[m][0], acc[m][1], BITS);
}

/* Blocks [b0, b0 + nb) for every row. */
ALWAYS_INLINE void columns(struct job *j, int64_t b0, int64_t nb, const int BITS) {
    if (j->M < STRIP_ROWS) {
        int m = 0;
        for (; m + 2 <= j->M; m += 2) {
            int64_t b = 0;
            for (; b + 2 <= nb; b += 2) direct_tile(j, m, b0 + b, 2, 2, BITS);
            for (; b < nb; b++) direct_tile(j, m, b0 + b, 2, 1, BITS);
        }
        for (; m < j->M; m++) {
            int64_t b = 0;
            for (; b + 2 <= nb; b += 2) direct_tile(j, m, b0 + b, 1, 2, BITS);
            for (; b < nb; b++) direct_tile(j, m, b0 + b, 1, 1, BITS);
        }
        return;
    }
    float *strip = aligned_alloc(64, (size_t)j->K * 16 * sizeof(float));
    if (!strip) {
        j->failed = 1;
        return;
    }
    for (int64_t b = b0; b < b0 + nb; b++) {
        for (int g = 0; g < j->K / j->group; g++)
            for (int k = g * j->group; k < (g + 1) * j->group; k++)
                widen(j, b, k, group_scales(j, b, g), BITS, (__m256 *)(strip + k * 16), (__m256 *)(strip + k * 16 + 8));
        int m = 0;
        for (; m + 6 <= j->M; m += 6) strip_tile(j, strip, m, b, 6, BITS);
        switch (j->M - m) { /* the rest: a constant row count at each call, so the tile unrolls */
        case 5: strip_tile(j, strip, m, b, 5, BITS); break;
        case 4: strip_tile(j, strip, m, b, 4, BITS); break;
        case 3: strip_tile(j, strip, m, b, 3, BITS); break;
        case 2: strip_tile(j, strip, m, b, 2, BITS); break;
        case 1: strip_tile(j, strip, m, b, 1, BITS); break;
        }
    }
    free(strip);
}

/* Each part takes an even share of the 16-column blocks (sums run the same whatever the split). */
static void columns_part(void *ctx, int part, int parts) {
    struct job *j = ctx;
    const int64_t b0 = pool_share(j->N / 16, part, parts), nb = pool_share(j->N / 16, part + 1, parts) - b0;
    if (j->bits == 4) columns(j, b0, nb, 4); /* a constant at each call: the tiles unroll for it */
    else columns(j, b0, nb, 8);
}

/* A second thread pays from about this many multiply-adds (as csrc/quant_matmul.c). */
#define THREADS_FROM (1 << 16)

static int run(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
               int threads, int bits) {
    if (M <= 0 || N <= 0) return 0;
    struct job j = {packed, scales, x, y, M, K, group, N, bits, 0};
    if ((int64_t)M * N * K < THREADS_FROM) threads = 1;
    if (threads > N / 16) threads = N / 16;
    pool_run(threads, columns_part, &j);
    return j.failed ? PC_NO_MEMORY : PC_OK;
}

int int4_matmul_f32(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                    int threads) {
    return run(x, packed, scales, y, M, K, N, group, threads, 4);
}

int int8_matmul_f32(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N,
                    int threads) {
    return run(x, packed, scales, y, M, K, N, K, threads, 8);
}

#else
int int4_matmul_f32(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                    int threads) {
    (void)x, (void)packed, (void)scales, (void)y, (void)M, (void)K, (void)N, (void)group, (void)threads;
    return PC_UNSUPPORTED;
}

int int8_matmul_f32(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N,
                    int threads) {
    (void)x, (void)packed, (void)scales, (void)y, (void)M, (void)K, (void)N, (void)threads;
    return PC_UNSUPPORTED;
}
#endif
