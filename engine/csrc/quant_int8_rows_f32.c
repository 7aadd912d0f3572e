/* y = x W^T for 4-bit and 8-bit weights and fp32 rows rounded to int8 per 32 inputs, on AVX2: the
 * int8-row kernels of quant_int8_rows.h for CPUs without AVX-512 VNNI (and fp32 models). vpmaddubsw
 * multiplies unsigned weight bytes by signed row bytes and adds each pair into a 16-bit word, 32
 * multiply-adds an instruction where an fp32 FMA does 8 (what llama.cpp does on AVX2). Per 32 inputs
 * the integer sums are exact, then scaled in fp32 (d = max |x| / 127, xq the rounded row):
 *   4-bit: sum_k x[k] w[n, k] = d * scale * sum_k xq[k] q[k] + shift * sum_k x[k], shift = zero - 8 scale
 *          (the second sum over the unrounded x). A word holds two products, at most 2 * 15 * 127, so the
 *          words of a whole 32 inputs add up in 16 bits (8 * 3810 < 2^15) before one vpmaddwd widens them.
 *   8-bit: sum_k x[k] w[n, k] = sum_a scale * d_a * sum_k xq[k] q[k]. The packed bytes are tile8_i8's
 *          (q + 128); one xor makes them q, and vpmaddubsw takes |q| against the row's bytes with q's
 *          sign (vpsignb): a word at most 2 * 128 * 127 < 2^15, widened each quad.
 * Each output is summed in the same order whatever the row count or tile: a row computes bit-identically
 * alone or in a batch.
 *
 * Layouts (engine/quant/packing.py), N % 16 == 0, K % 32 == 0:
 *   4-bit packed [N/16][K/4][32] (int4_pack with int8_rows): byte 4c + t of (block b, quad j) holds
 *         q[16b + c, 4j + (0, 2, 1, 3)[t]] in its low nibble and q[16b + 8 + c, same k] in its high one
 *         (c < 8): one AND gives columns 0-7, a shift and an AND 8-15, each column's quad in its 32-bit
 *         lane in the k order quantize stores xq in (tile8_i8's, whose bytes this kernel shares);
 *         scales and shifts [N/16][G][2][16] fp32 as quant_matmul_f32.c's.
 *   8-bit packed [N/16][K/4][64] as tile8_i8's; scales [N] fp32.
 *   x [M, K] fp32 contiguous, y [M, N] fp32.
 * Return PC_OK, PC_UNSUPPORTED without AVX2 and FMA, PC_NO_MEMORY, PC_BAD_SHAPE (K % 32 != 0, or a 4-bit group
 * other than 32 times a power of two).
 */
#include <stdint.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"
#include "pool.h"

#ifdef PC_AVX2_FMA
#include <immintrin.h>

struct job {
    const uint8_t *packed;
    const float *scales, *xd, *xsum;
    const int8_t *xq;
    float *y;
    int M, K, group_shift, N, bits; /* groups of 32 << group_shift inputs (4-bit) */
};

/* Row x's quad j as one 32-bit word, broadcast. */
ALWAYS_INLINE __m256i quad(const int8_t *row, int j) {
    int32_t word;
    memcpy(&word, row + 4 * j, 4);
    return _mm256_set1_epi32(word);
}

/* A tile's sums into y: rows [m0, m0 + MR), columns [16 b0, 16 (b0 + NB)). */
ALWAYS_INLINE void store_tile(const struct job *j, int64_t b0, int m0, const int MR, const int NB, __m256 acc[4][4][2]) {
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++)
            for (int h = 0; h < 2; h++)
                _mm256_storeu_ps(j->y + (int64_t)(m0 + m) * j->N + (b0 + b) * 16 + 8 * h, acc[m][b][h]);
}

/* 4-bit: MR rows by NB blocks of 16 columns, MR * NB <= 4. The arrays have fixed sizes (a VLA of MR would live
 * on the stack); MR and NB are constants at every call, so the compiler keeps the used sums in registers
 * (3 rows' integer and fp32 sums fill AVX2's 16 registers; what does not fit spills to the stack, which,
 * unlike y, the compiler knows no other pointer reads). Job fields are copied into locals for the same
 * reason: a store through y could otherwise change them, and each store reloaded them (measured: half
 * the kernel's time went to the per-32-input step). */
ALWAYS_INLINE void tile4(const struct job *j, int64_t b0, int m0, const int MR, const int NB) {
    const int K = j->K, A = K / 32, shift = j->group_shift, G = A >> shift;
    const uint8_t *packed = j->packed + b0 * (K / 4) * 32;
    const float *scales = j->scales + b0 * G * 32, *xd = j->xd + (int64_t)m0 * A, *xsum = j->xsum + (int64_t)m0 * A;
    const int8_t *xq = j->xq + (int64_t)m0 * K;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[4][4][2];
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_ps();
    for (int a = 0; a < A; a++) {
        __m256i words[4][4][2];
        for (int m = 0; m < MR; m++)
            for (int b = 0; b < NB; b++) words[m][b][0] = words[m][b][1] = _mm256_setzero_si256();
        /* unrolled, GCC keeps each sum in one register (rolled, it copied all six each step): one thread,
         * 64 rows, AMD EPYC Zen 3, 66-73 -> 73-83 GMAC/s; 4-row tiles gain nothing more */
#pragma GCC unroll 8
        for (int q = 8 * a; q < 8 * a + 8; q++)
            for (int b = 0; b < NB; b++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(packed + (b * (K / 4) + q) * 32));
                const __m256i w[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
                for (int m = 0; m < MR; m++) {
                    const __m256i x = quad(xq + (int64_t)m * K, q);
                    for (int h = 0; h < 2; h++)
                        words[m][b][h] = _mm256_add_epi16(words[m][b][h], _mm256_maddubs_epi16(w[h], x));
                }
            }
        const int g = a >> shift;
        for (int b = 0; b < NB; b++) {
            const float *s = scales + ((b * G + g) * 2) * 16;
            for (int m = 0; m < MR; m++) {
                const __m256 d = _mm256_set1_ps(xd[m * A + a]), sum = _mm256_set1_ps(xsum[m * A + a]);
                for (int h = 0; h < 2; h++) {
                    const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(words[m][b][h], ones));
                    const __m256 total = _mm256_fmadd_ps(dots, _mm256_mul_ps(_mm256_loadu_ps(s + 8 * h), d), acc[m][b][h]);
                    acc[m][b][h] = _mm256_fmadd_ps(sum, _mm256_loadu_ps(s + 16 + 8 * h), total);
                }
            }
        }
    }
    store_tile(j, b0, m0, MR, NB, acc);
}

/* 8-bit: as tile4, the per-column scale folded into each 32 inputs' step. */
ALWAYS_INLINE void tile8(const struct job *j, int64_t b0, int m0, const int MR, const int NB) {
    const int K = j->K, A = K / 32;
    const uint8_t *packed = j->packed + b0 * (K / 4) * 64;
    const float *scales = j->scales + b0 * 16, *xd = j->xd + (int64_t)m0 * A;
    const int8_t *xq = j->xq + (int64_t)m0 * K;
    const __m256i offset = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc[4][4][2];
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_ps();
    for (int a = 0; a < A; a++) {
        __m256i dot[4][4][2];
        for (int m = 0; m < MR; m++)
            for (int b = 0; b < NB; b++) dot[m][b][0] = dot[m][b][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int q = 8 * a; q < 8 * a + 8; q++)
            for (int b = 0; b < NB; b++)
                for (int h = 0; h < 2; h++) {
                    const uint8_t *src = packed + (b * (K / 4) + q) * 64 + 32 * h;
                    const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)src), offset);
                    const __m256i magnitude = _mm256_abs_epi8(w);
                    for (int m = 0; m < MR; m++) {
                        const __m256i x = _mm256_sign_epi8(quad(xq + (int64_t)m * K, q), w);
                        dot[m][b][h] = _mm256_add_epi32(dot[m][b][h],
                                                        _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), ones));
                    }
                }
        for (int m = 0; m < MR; m++) {
            const __m256 d = _mm256_set1_ps(xd[m * A + a]);
            for (int b = 0; b < NB; b++)
                for (int h = 0; h < 2; h++) {
                    const __m256 ds = _mm256_mul_ps(_mm256_loadu_ps(scales + b * 16 + 8 * h), d);
                    acc[m][b][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][b][h]), ds, acc[m][b][h]);
                }
        }
    }
    store_tile(j, b0, m0, MR, NB, acc);
}

ALWAYS_INLINE void tile(const struct job *j, int64_t b0, int m0, const int MR, const int NB, const int BITS) {
    if (BITS == 4) tile4(j, b0, m0, MR, NB);
    else tile8(j, b0, m0, MR, NB);
}

/* Blocks [b0, b0 + nb) for rows [m0, M): chunks of 3 rows one block at a time (its weights stay in L1 while
 * every chunk takes them; 3 rows' six 16-bit and six fp32 sums, two weight vectors and the broadcasts about
 * fill AVX2's 16 registers. One thread at 64 rows, 4-bit, AMD EPYC 2026-12-06: 3 rows 70-79 GMAC/s, 4 rows
 * 64-68, 2 rows by 2 blocks 57-61), fewer rows over more blocks. */
ALWAYS_INLINE void columns(const struct job *j, int64_t b0, int64_t nb, int m0, int M, const int BITS) {
    int m = m0;
    if (M - m0 >= 3) {
        for (int64_t b = b0; b < b0 + nb; b++)
            for (m = m0; m + 3 <= M; m += 3) tile(j, b, m, 3, 1, BITS);
        m = M - (M - m0) % 3;
    }
    for (; m + 2 <= M; m += 2) {
        int64_t b = b0;
        for (; b + 2 <= b0 + nb; b += 2) tile(j, b, m, 2, 2, BITS);
        for (; b < b0 + nb; b++) tile(j, b, m, 2, 1, BITS);
    }
    for (; m < M; m++) {
        int64_t b = b0;
        for (; b + 4 <= b0 + nb; b += 4) tile(j, b, m, 1, 4, BITS);
        for (; b < b0 + nb; b++) tile(j, b, m, 1, 1, BITS);
    }
}

/* Rows a part takes through all its blocks before the next rows: their int8 form stays in L2 (512 KB a
 * core on an AMD EPYC of this kind: 128 rows of 1536 inputs are 192 KB). */
#define ROWS_AT_ONCE 128

/* Each part takes an even share of the 16-column blocks (sums run the same whatever the split). */
static void columns_part(void *ctx, int part, int parts) {
    const struct job *j = ctx;
    const int64_t b0 = pool_share(j->N / 16, part, parts), nb = pool_share(j->N / 16, part + 1, parts) - b0;
    for (int m0 = 0; m0 < j->M; m0 += ROWS_AT_ONCE) {
        const int M = j->M - m0 < ROWS_AT_ONCE ? j->M : m0 + ROWS_AT_ONCE;
        if (j->bits == 4) columns(j, b0, nb, m0, M, 4); /* a constant at each call: the tiles unroll for it */
        else columns(j, b0, nb, m0, M, 8);
    }
}

struct rows_job {
    const float *x;
    int8_t *xq;
    float *xd, *xsum;
    int M, K;
};

/* Rows of x to int8 per 32 inputs, round to nearest even: xq with each quad's k in the order 0, 2, 1, 3,
 * xd the step, xsum the sum of the unrounded inputs. */
static void quantize(void *ctx, int part, int parts) {
    const struct rows_job *j = ctx;
    const __m256i quads = _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256 sign = _mm256_set1_ps(-0.f);
    const int A = j->K / 32;
    for (int64_t m = pool_share(j->M, part, parts); m < pool_share(j->M, part + 1, parts); m++)
        for (int a = 0; a < A; a++) {
            const int64_t at = m * A + a, k = m * j->K + 32 * a;
            __m256 v[4], top = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(j->x + k + 8 * i);
                top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
                sum = _mm256_add_ps(sum, v[i]);
            }
            __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
            t = _mm_max_ps(t, _mm_movehl_ps(t, t));
            const float most = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            j->xsum[at] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
            j->xd[at] = most / 127.f;
            const __m256 inv = _mm256_set1_ps(most > 0.f ? 127.f / most : 0.f);
            __m256i r[4];
            for (int i = 0; i < 4; i++)
                r[i] = _mm256_permutevar8x32_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), quads);
            /* packs work within 128-bit lanes: the 4-byte runs come out as v0 0-3, v1 0-3, v2 0-3, v3 0-3,
             * v0 4-7, ... and one permute puts them back in order */
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
            _mm256_storeu_si256((__m256i *)(j->xq + k), _mm256_permutevar8x32_epi32(bytes, order));
        }
}

/* A second thread pays from about this many multiply-adds (as csrc/quant_matmul.c). */
#define THREADS_FROM (1 << 16)

static int run(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
               int threads, int bits) {
    if (M <= 0 || N <= 0) return PC_OK;
    int shift = 0;
    while (32 << shift < group) shift++;
    if (K % 32 || (bits == 4 && 32 << shift != group)) return PC_BAD_SHAPE;
    const size_t A = K / 32;
    int8_t *xq = malloc((size_t)M * K + 2 * sizeof(float) * (size_t)M * A);
    if (!xq) return PC_NO_MEMORY;
    float *xd = (float *)(xq + (size_t)M * K), *xsum = xd + (size_t)M * A;
    struct rows_job r = {x, xq, xd, xsum, M, K};
    pool_run(threads < M ? threads : M, quantize, &r);
    struct job j = {packed, scales, xd, xsum, xq, y, M, K, shift, N, bits};
    if ((int64_t)M * N * K < THREADS_FROM) threads = 1;
    if (threads > N / 16) threads = N / 16;
    pool_run(threads, columns_part, &j);
    free(xq);
    return PC_OK;
}

int int4_matmul_f32_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N,
                       int group, int threads) {
    return run(x, packed, scales, y, M, K, N, group, threads, 4);
}

int int8_matmul_f32_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N,
                       int threads) {
    return run(x, packed, scales, y, M, K, N, K, threads, 8);
}

#else
int int4_matmul_f32_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N,
                       int group, int threads) {
    (void)x, (void)packed, (void)scales, (void)y, (void)M, (void)K, (void)N, (void)group, (void)threads;
    return PC_UNSUPPORTED;
}

int int8_matmul_f32_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N,
                       int threads) {
    (void)x, (void)packed, (void)scales, (void)y, (void)M, (void)K, (void)N, (void)threads;
    return PC_UNSUPPORTED;
}
#endif
