/* y = x W^T for weights kept 4-bit or 8-bit and a few bf16 rows (decode): the weights stream from
 * memory once in their small form (4-bit: 0.625 bytes a weight with its scales; 8-bit: 1; dense bf16
 * takes 2) and are widened in registers; the products are bf16 pair dot products (vdpbf16ps) with
 * fp32 accumulation. Each output is summed in the same order whatever the row count or tile, so a
 * row computes bit-identically alone or in a batch.
 *
 * 4-bit: w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n], g = k / group, q in 0..15 (the torch
 * int4 convention engine/quant/kernels.py uses). A nibble widens to the bf16 bits 0x4300 | q, which
 * are exactly 128 + q, so unpacking is one OR; per group
 *     sum_k x[k] w[n, k] = scale * sum_k x[k] (128 + q) + (zero - 136 scale) * sum_k x[k]
 * with both sums in fp32 (the products of two 8-bit mantissas are exact).
 * 8-bit: w[n, k] = q[n, k] * scale[n], q in -127..127 (exact in bf16), converted through fp32.
 * 4-bit with int8 activations (int4_matmul_i8, AVX-512 VNNI; what llama.cpp computes for Q4 weights, its
 * Q8 activations): each row is rounded to int8 per 32 inputs, x[k] ~ xq[k] * d (d = max |x| / 127), and
 * the nibbles meet them in integer dot products of 4 (vpdpbusd: twice the multiply-adds of vdpbf16ps)
 *     sum_k x[k] w[n, k] = d * scale * sum_k xq[k] q[k] + (zero - 8 scale) * sum_k x[k]
 * per 32 inputs, the integer sum exact, the second sum over the unrounded x.
 *
 * Layouts (built by engine/cpu_kernels.py's int4_pack / int8_pack), N % 16 == 0:
 *   4-bit packed [N/16][K/4][32] bytes (K % group == 0, group % 4 == 0): byte 2c + i of (block b,
 *           quad j) holds q[16b + c, 4j + i] in its low nibble and q[16b + c, 4j + 2 + i] in its
 *           high one (i = 0, 1): widened to 16-bit words, the low nibbles are one vector of bf16
 *           pairs (k = 4j, 4j + 1) per column and the high ones the next pair.
 *         scales [N/16][G][2][16] bf16: per block and group, 16 scales then 16 zeros.
 *   8-bit packed [N/16][K/2][32] int8 (K % 2 == 0): byte 2c + i of (block b, pair p) is
 *           q[16b + c, 2p + i]; scales [N] fp32. With int8 rows (int8_matmul_i8) a layout of its own,
 *           described at tile8_i8 (quant_int8_rows.h).
 *   x [M, K] bf16 contiguous, y [M, N] bf16.
 * Return PC_OK, PC_UNSUPPORTED where this CPU lacks AVX-512 BF16 and VNNI (the caller then uses torch),
 * PC_NO_MEMORY (common.h).
 */
#include <stdint.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"
#include "pool.h"

#ifdef PC_AVX512_BF16_VNNI
#include <immintrin.h>


/* 16 bf16 values as fp32. */
ALWAYS_INLINE __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* MR rows by NB blocks of 16 columns; MR and NB are constants at every call, so the accumulators
 * stay in registers. */
ALWAYS_INLINE void tile4(const uint8_t *packed, const uint16_t *scales, const uint16_t *x, const float *xsum,
                        uint16_t *y, int64_t b0, int m0, int K, int G, int group, int N, const int MR, const int NB) {
    const __m512i low4 = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
    const __m512 minus136 = _mm512_set1_ps(-136.f);
    __m512 total[MR][NB];
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++) total[m][b] = _mm512_setzero_ps();
    const int quads = group / 4;
    for (int g = 0; g < G; g++) {
        __m512 part[MR][NB];
        for (int m = 0; m < MR; m++)
            for (int b = 0; b < NB; b++) part[m][b] = _mm512_setzero_ps();
        for (int j = g * quads; j < (g + 1) * quads; j++) {
            for (int b = 0; b < NB; b++) {
                const uint8_t *src = packed + ((b0 + b) * (K / 4) + j) * 32;
                const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
                const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(words, low4, bias, 0xEA); /* (w & 15) | bias */
                const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(words, 4), bias);
                for (int m = 0; m < MR; m++) {
                    const int32_t *xr = (const int32_t *)(x + (int64_t)(m0 + m) * K + 4 * j);
                    part[m][b] = _mm512_dpbf16_ps(part[m][b], lo, (__m512bh)_mm512_set1_epi32(xr[0]));
                    part[m][b] = _mm512_dpbf16_ps(part[m][b], hi, (__m512bh)_mm512_set1_epi32(xr[1]));
                }
            }
        }
        for (int b = 0; b < NB; b++) {
            const uint16_t *sz = scales + (((b0 + b) * G + g) * 2) * 16;
            const __m512 s = load16_bf16(sz), z = load16_bf16(sz + 16);
            const __m512 shift = _mm512_fmadd_ps(minus136, s, z); /* zero - 136 scale */
            for (int m = 0; m < MR; m++) {
                total[m][b] = _mm512_fmadd_ps(part[m][b], s, total[m][b]);
                total[m][b] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[(int64_t)(m0 + m) * G + g]), shift, total[m][b]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++)
            _mm256_storeu_si256((__m256i *)(y + (int64_t)(m0 + m) * N + (b0 + b) * 16),
                                (__m256i)_mm512_cvtneps_pbh(total[m][b]));
}

ALWAYS_INLINE void tile8(const int8_t *packed, const float *scales, const uint16_t *x, uint16_t *y, int64_t b0,
                         int m0, int K, int N, const int MR, const int NB) {
    __m512 acc[MR][NB];
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_ps();
    for (int p = 0; p < K / 2; p++) {
        for (int b = 0; b < NB; b++) {
            const int8_t *src = packed + ((b0 + b) * (K / 2) + p) * 32;
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16))));
            const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);
            for (int m = 0; m < MR; m++) {
                const int32_t *xr = (const int32_t *)(x + (int64_t)(m0 + m) * K + 2 * p);
                acc[m][b] = _mm512_dpbf16_ps(acc[m][b], w, (__m512bh)_mm512_set1_epi32(xr[0]));
            }
        }
    }
    for (int b = 0; b < NB; b++) {
        const __m512 s = _mm512_loadu_ps(scales + (b0 + b) * 16);
        for (int m = 0; m < MR; m++)
            _mm256_storeu_si256((__m256i *)(y + (int64_t)(m0 + m) * N + (b0 + b) * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[m][b], s)));
    }
}

#include "quant_int8_rows.h"

/* The kinds of tile: KIND is a constant at every call. */
enum kind { INT4 = 4, INT8 = 8, INT4_I8 = 12, INT8_I8 = 16, INT8G_I8 = 20, INT8G16_I8 = 24, INT5_I8 = 28 };

#include "quant_amx.h"
#include "quant_amx_bf16.h"

/* AHEAD: the int8-row tiles fetch the next NB blocks while they compute (fetch, quant_int8_rows.h). */
ALWAYS_INLINE void any_tile(const void *packed, const void *scales, const void *x, const float *xd, const float *xsum,
                            const float *xqsum, uint16_t *y, int64_t b0, int m0, int K, int G, int group, int N,
                            const int MR, const int NB, const int AHEAD, const enum kind KIND) {
    if (KIND == INT4) tile4(packed, scales, x, xsum, y, b0, m0, K, G, group, N, MR, NB);
    else if (KIND == INT8) tile8(packed, scales, x, y, b0, m0, K, N, MR, NB);
    else if (KIND == INT4_I8) tile4_i8(packed, scales, x, xd, xsum, y, b0, m0, K, G, group, N, MR, NB, 4, AHEAD);
    else if (KIND == INT5_I8) tile4_i8(packed, scales, x, xd, xsum, y, b0, m0, K, G, group, N, MR, NB, 5, AHEAD);
    else if (KIND == INT8G_I8) tile8g_i8(packed, scales, x, xd, xsum, xqsum, y, b0, m0, K, G, N, MR, NB, 32, AHEAD);
    else if (KIND == INT8G16_I8) tile8g_i8(packed, scales, x, xd, xsum, xqsum, y, b0, m0, K, G, N, MR, NB, 16, AHEAD);
    else tile8_i8(packed, scales, x, xd, xsum, y, b0, m0, K, N, MR, NB, AHEAD);
}

/* Blocks [b0, b0 + nb) for rows [m0, M): from 8 rows, a few blocks at a time met by every chunk of rows
 * (block by block, all chunks: 24-48 rows of SmolLM2's linears streamed 10-25% faster than chunk by chunk);
 * the rows left over in fewer rows over more blocks at once (about the same count of independent
 * accumulators; one row over 8 blocks streamed SmolLM2's 4-bit weights at 10.8 GB/s against 8.6 over 4). */
ALWAYS_INLINE void columns(const void *packed, const void *scales, const void *x, const float *xd, const float *xsum,
                           const float *xqsum, uint16_t *y, int64_t b0, int nb, int m0, int M, int K, int G, int group,
                           int N, const enum kind KIND) {
#define TILE(MR, NB, AHEAD) any_tile(packed, scales, x, xd, xsum, xqsum, y, b0 + b, m, K, G, group, N, MR, NB, AHEAD, KIND)
/* the next NB blocks fetched ahead when `when` (where they exist, by the first chunk of rows to reach them) */
#define TILE_AHEAD(MR, NB, when) do { if (when) TILE(MR, NB, 1); else TILE(MR, NB, 0); } while (0)
    int m = m0;
    if (M - m0 >= 8) { /* each block's weights stay in L1 while every chunk of 8 rows takes them */
        /* The LM head's rows left over after the chunks take these blocks too, in smaller tiles (REST), as its
         * part of the weights would not stay in L2 for a pass of their own: at 29-31 rows, a step's usual
         * count at 32 sessions, it read its 28 MB four times (Zen 5, 49152x576 at 12-31 rows 1.06-1.55x).
         * SmolLM2's 4-bit linears take a pass of their own, in tiles of more blocks (0.86-0.99x in place). */
        const int in_place = KIND == INT8_I8 && (int64_t)nb * K * 16 > (512 << 10);
#define REST(NB, CHUNK) do { \
            if (!in_place) break; \
            if ((CHUNK) > 4 && m + 4 <= M) TILE(4, NB, 0), m += 4; \
            if (m + 2 <= M) TILE(2, NB, 0), m += 2; \
            if (m < M) TILE(1, NB, 0); \
        } while (0)
        int b = 0;
        /* 4-bit with int8 rows: two blocks at a time, 16 accumulators, as vpdpbusd's latency wants (8 held an
         * AMD EPYC Zen 5 at ~80% of its throughput); SmolLM2's shapes 1.25-1.39x at 16-64 rows there */
        if (KIND == INT4_I8 || KIND == INT5_I8)
            for (; b + 2 <= nb; b += 2)
                for (m = m0; m + 8 <= M; m += 8) TILE_AHEAD(8, 2, m == m0 && b + 4 <= nb);
        /* 8-bit per channel (the LM head) from 32 rows: 4 rows by 3 blocks, 12 accumulators and the weights
         * read once per 4 rows; 49152x576 on a Zen 5 1.14-1.29x at 32-64 rows, 0.71x at 8 (so not below 32) */
        const int chunk = KIND == INT8_I8 && M - m0 >= 32 ? 4 : 8;
        if (chunk == 4) {
            for (; b + 3 <= nb; b += 3) {
                for (m = m0; m + 4 <= M; m += 4) TILE_AHEAD(4, 3, m == m0 && b + 6 <= nb);
                REST(3, 4);
            }
            for (; b < nb; b++) {
                for (m = m0; m + 4 <= M; m += 4) TILE(4, 1, 0);
                REST(1, 4);
            }
        } else
            for (; b < nb; b++) {
                for (m = m0; m + 8 <= M; m += 8) TILE_AHEAD(8, 1, m == m0 && b + 2 <= nb);
                REST(1, 8);
            }
#undef REST
        if (in_place) return;
        m = M - (M - m0) % chunk; /* the rows left over, in a pass of their own */
    }
    for (; m + 4 <= M; m += 4) {
        int b = 0;
        for (; b + 2 <= nb; b += 2) TILE_AHEAD(4, 2, b + 4 <= nb);
        for (; b < nb; b++) TILE(4, 1, 0);
    }
    /* one or two rows: no fetching ahead (the weights' plain streams, which the hardware's prefetchers
     * follow; fetching ahead took a one-session run to 0.94x) */
    for (; m + 2 <= M; m += 2) {
        int b = 0;
        for (; b + 4 <= nb; b += 4) TILE(2, 4, 0);
        for (; b < nb; b++) TILE(2, 1, 0);
    }
    for (; m < M; m++) {
        int b = 0;
        for (; b + 8 <= nb; b += 8) TILE(1, 8, 0);
        for (; b + 4 <= nb; b += 4) TILE(1, 4, 0);
        for (; b < nb; b++) TILE(1, 1, 0);
    }
#undef TILE_AHEAD
#undef TILE
}

struct job {
    const void *packed, *scales, *x;
    const float *xd, *xsum, *xqsum;
    void *y;
    int M, K, G, group, N;
    enum kind kind;
    int amx; /* whole tiles of 16 rows take the AMX tiles (quant_amx.h) */
};

/* Rows a part takes through all its blocks before the next rows (a multiple of 8): a step's rows in
 * their int8 form (1024 x 1536 bytes for a prompt chunk through a down projection) would not stay in L2
 * while every block reads them. Measured: no change on a Xeon with 2 MB of L2 a core (256-1024 rows,
 * both builds alternating); meant for 1 MB (an AMD EPYC), where 512 and 1024 rows took 2.2 and 2.3x
 * the time of half as many. */
#define ROWS_AT_ONCE 256

/* Each part takes an even share of the 16-column blocks (sums run the same whatever the split). */
static void columns_part(void *ctx, int part, int parts) {
    const struct job *j = ctx;
    const int64_t b0 = pool_share(j->N / 16, part, parts), nb = pool_share(j->N / 16, part + 1, parts) - b0;
#ifdef PC_AMX
    uint8_t *widened = j->amx ? malloc((size_t)j->K * 16) : NULL;
    if (widened) amx_configure();
#endif
    for (int m0 = 0; m0 < j->M; m0 += ROWS_AT_ONCE) {
        int M = j->M - m0 < ROWS_AT_ONCE ? j->M : m0 + ROWS_AT_ONCE, from = m0;
#ifdef PC_AMX
        if (widened) {
#define AMX_COLUMNS(KIND) amx_columns(j->packed, j->scales, j->x, j->xd, j->xsum, j->xqsum, j->y, b0, (int)nb, m0, \
                                      (M - m0) / 16, j->K, j->G, j->group, j->N, widened, KIND)
            if (j->kind == INT4_I8) AMX_COLUMNS(INT4_I8);
            else if (j->kind == INT5_I8) AMX_COLUMNS(INT5_I8);
            else if (j->kind == INT8G_I8) AMX_COLUMNS(INT8G_I8);
            else AMX_COLUMNS(INT8_I8);
#undef AMX_COLUMNS
            from = M - (M - m0) % 16;
        }
#endif
        if (from == M) continue;
#define COLUMNS(KIND) \
        columns(j->packed, j->scales, j->x, j->xd, j->xsum, j->xqsum, j->y, b0, (int)nb, from, M, j->K, j->G, j->group, \
                j->N, KIND)
        if (j->kind == INT4) COLUMNS(INT4); /* a constant at each call: the tiles unroll for it */
        else if (j->kind == INT8) COLUMNS(INT8);
        else if (j->kind == INT4_I8) COLUMNS(INT4_I8);
        else if (j->kind == INT5_I8) COLUMNS(INT5_I8);
        else if (j->kind == INT8G_I8) COLUMNS(INT8G_I8);
        else if (j->kind == INT8G16_I8) COLUMNS(INT8G16_I8);
        else COLUMNS(INT8_I8);
#undef COLUMNS
    }
#ifdef PC_AMX
    if (widened) _tile_release();
    free(widened);
#endif
}

/* A second thread pays from ~THREADS_FROM multiply-adds: the pool's threads are warm (measured, one
 * row: 192x576 2.1 us on one thread, 1.6 on two; 576x576 6.2 against 4.1; 576x1536 19.9 against 11.0). */
#define THREADS_FROM (1 << 16)

static void run(struct job *j, int threads) {
    if ((int64_t)j->M * j->N * j->K < THREADS_FROM) threads = 1;
    if (threads > j->N / 16) threads = j->N / 16;
    pool_run(threads, columns_part, j);
}

int int4_matmul(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                int threads) {
    if (M <= 0 || N <= 0) return 0;
    const int G = K / group;
    float *xsum = malloc(sizeof(float) * (size_t)M * G);
    if (!xsum) return PC_NO_MEMORY;
    const uint16_t *xb = (const uint16_t *)x;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            float s = 0.f;
            for (int k = g * group; k < (g + 1) * group; k++) {
                const uint32_t u = (uint32_t)xb[(int64_t)m * K + k] << 16;
                float f;
                __builtin_memcpy(&f, &u, 4);
                s += f;
            }
            xsum[(int64_t)m * G + g] = s;
        }
    struct job j = {packed, scales, x, NULL, xsum, NULL, y, M, K, G, group, N, INT4, 0};
    run(&j, threads);
    free(xsum);
    return 0;
}

/* Rows rounded to int8 (quantize_rows), then the tiles of `kind`. */
static int with_int8_rows(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N,
                          int group, int threads, int amx, enum kind kind) {
    if (M <= 0 || N <= 0) return 0;
    const size_t A = K / 32, floats = 5 * (size_t)M * A + M; /* xd; xsum and xqsum (per 16 at most); xbias */
    int8_t *xq = malloc((size_t)M * K + sizeof(float) * floats);
    if (!xq) return PC_NO_MEMORY;
    float *xd = (float *)(xq + (size_t)M * K), *xsum = xd + M * A, *xqsum = xsum + 2 * M * A, *xbias = xqsum + 2 * M * A;
    const int grouped = kind == INT8G_I8 || kind == INT8G16_I8;
    struct rows_job r = {x, xq, xd, xsum, kind == INT8_I8 ? xbias : NULL, grouped ? xqsum : NULL, M, K,
                         kind == INT8G16_I8};
    pool_run(threads < M ? threads : M, quantize_rows, &r);
    struct job j = {packed, scales, xq, xd, kind == INT8_I8 ? xbias : xsum, xqsum, y, M, K, K / group, group, N, kind,
                    amx && M >= 16 && AMX_KIND(kind) && amx_permitted()};
    run(&j, threads);
    free(xq);
    return 0;
}

/* amx: whole tiles of 16 rows take the AMX tiles where this build and the kernel have them (quant_amx.h);
 * the results are the same either way. */
int int4_matmul_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                   int threads, int amx) {
    return with_int8_rows(x, packed, scales, y, M, K, N, group, threads, amx, INT4_I8);
}

int int5_matmul_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                   int threads, int amx) {
    return with_int8_rows(x, packed, scales, y, M, K, N, group, threads, amx, INT5_I8);
}

int int8_matmul_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int threads,
                   int amx) {
    return with_int8_rows(x, packed, scales, y, M, K, N, K, threads, amx, INT8_I8);
}

int int8g_matmul_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                    int threads, int amx) {
    if (group != 16 && group != 32) return PC_UNSUPPORTED;
    return with_int8_rows(x, packed, scales, y, M, K, N, group, threads, amx, group == 16 ? INT8G16_I8 : INT8G_I8);
}

int int8_matmul(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int threads) {
    struct job j = {packed, scales, x, NULL, NULL, NULL, y, M, K, 1, K, N, INT8, 0};
    if (M > 0 && N > 0) run(&j, threads);
    return 0;
}

int amx_tiles(void) { return AMX_KIND(INT4_I8) && amx_permitted(); }

#ifdef PC_AMX_BF16
int amx_bf16_tiles(void) { return amx_permitted(); }
#else
int amx_bf16_tiles(void) { return 0; }
#endif

/* 4-bit weights on AMX bf16 tiles (quant_amx_bf16.h): PC_UNSUPPORTED where the build or Linux lacks them. */
int int4_matmul_bf16_tiles(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N,
                           int group, int threads) {
#ifdef PC_AMX_BF16
    if (M <= 0 || N <= 0) return 0;
    if (!amx_permitted() || K % 32 || group % 4) return PC_UNSUPPORTED;
    const int whole = M / 16 * 16;
    uint16_t *tail = NULL; /* the rows past the last whole tile, then zeros */
    if (whole != M) {
        if (!(tail = calloc((size_t)16 * K, 2))) return PC_NO_MEMORY;
        memcpy(tail, (const uint16_t *)x + (int64_t)whole * K, (size_t)(M - whole) * K * 2);
    }
    struct bf16_job j = {packed, scales, x, tail, y, M, K, K / group, group, N};
    if ((int64_t)M * N * K < THREADS_FROM) threads = 1;
    pool_run(threads < N / 16 ? threads : N / 16, bf16_part, &j);
    free(tail);
    return 0;
#else
    (void)x, (void)packed, (void)scales, (void)y, (void)M, (void)K, (void)N, (void)group, (void)threads;
    return PC_UNSUPPORTED;
#endif
}

int64_t amx_tiles_computed(void) { return amx_tile_count; }

#else
#define UNUSED_MATMUL (void)x, (void)packed, (void)scales, (void)y, (void)M, (void)K, (void)N, (void)threads
int int8g_matmul_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                    int threads, int amx) {
    UNUSED_MATMUL, (void)group, (void)amx;
    return PC_UNSUPPORTED;
}

int int8_matmul_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int threads,
                   int amx) {
    UNUSED_MATMUL, (void)amx;
    return PC_UNSUPPORTED;
}

int int5_matmul_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                   int threads, int amx) {
    UNUSED_MATMUL, (void)group, (void)amx;
    return PC_UNSUPPORTED;
}

int int4_matmul_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                   int threads, int amx) {
    UNUSED_MATMUL, (void)group, (void)amx;
    return PC_UNSUPPORTED;
}

int int4_matmul(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                int threads) {
    UNUSED_MATMUL, (void)group;
    return PC_UNSUPPORTED;
}

int int8_matmul(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int threads) {
    UNUSED_MATMUL;
    return PC_UNSUPPORTED;
}

int amx_tiles(void) { return 0; }

int amx_bf16_tiles(void) { return 0; }

int int4_matmul_bf16_tiles(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N,
                           int group, int threads) {
    UNUSED_MATMUL, (void)group;
    return PC_UNSUPPORTED;
}

int64_t amx_tiles_computed(void) { return 0; }
#endif
