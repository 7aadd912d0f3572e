/* The int8-activation half of quant_matmul.c (included there, after load16_bf16): bf16 rows rounded to
 * int8 per 32 inputs (quantize_rows) and the tiles that meet them with 4-bit weights (tile4_i8), 8-bit
 * ones per output channel (tile8_i8) and 8-bit ones in groups of 32 (tile8g_i8). */
#ifndef PAGEDCHAT_QUANT_INT8_ROWS_H
#define PAGEDCHAT_QUANT_INT8_ROWS_H

/* 4-bit weights, int8 activations. The packed bytes are tile4's: a quad's 32 bytes widened to 16-bit
 * words, (w | w << 4) & 0x0F0F puts q[c, 4j + i] in byte 0 and q[c, 4j + 2 + i] in byte 1 of word 2c + i,
 * so column c's 32-bit lane holds the quad's k in the order 0, 2, 1, 3: quantize_rows stores xq so.
 * BITS 5 (GGUF's Q5_0, Q5_1 and Q5_K, held in 5 bits): w = (q - 16) * scale + zero, q in 0..31; each
 * block of 16 columns holds its quads' 32 nibble bytes (as 4-bit), then 8 bytes of high bits per quad,
 * bit t of the 64 standing for byte t of the widened quad (q[c, 4j + (0, 2, 1, 3)[t % 4]], c = t / 4):
 * one masked add of 16 per quad, the mask loaded straight from memory (kept apart, the nibbles' loads
 * stay aligned; one row of a 3072x576 matrix 26 -> 22 us, int8 groups 19, 4-bit 17, Xeon 2026-12-04). */
/* Fetching ahead (AHEAD in the tiles): while a tile computes its blocks for 32 inputs, the next NB blocks'
 * weights and scales for the same inputs are fetched into L1. Weights streaming from memory (a step's
 * matrices, each read once) held the tiles well below their speed with the weights in cache: on an AMD
 * EPYC Zen 5, 16 rows of a 1536x576 4-bit matrix took 85.6 us with 60 such matrices in turn against 35.5
 * with one; with the fetches 39.4. */
ALWAYS_INLINE void fetch(const void *from, const int bytes) {
    for (int at = 0; at < bytes; at += 64) _mm_prefetch((const char *)from + at, _MM_HINT_T0);
}

ALWAYS_INLINE void tile4_i8(const uint8_t *packed, const uint16_t *scales, const int8_t *xq, const float *xd,
                            const float *xsum, uint16_t *y, int64_t b0, int m0, int K, int G, int group, int N,
                            const int MR, const int NB, const int BITS, const int AHEAD) {
    const __m512i nibbles = _mm512_set1_epi16(0x0F0F), sixteen = _mm512_set1_epi8(16);
    const __m512 minus_offset = _mm512_set1_ps(BITS == 5 ? -16.f : -8.f);
    const int stride = BITS == 5 ? 40 : 32;
    const int A = K / 32, per_group = group / 32;
    /* Written for the compiler: the quads' loop unrolled and the rows' addresses hoisted, so that the
     * accumulators stay in registers (before, gcc rotated them through copies each quad and kept the
     * row pointers on the stack: a third of vpdpbusd's peak on an AMD EPYC Zen 5). */
    const int32_t *xr[MR];
    for (int m = 0; m < MR; m++) xr[m] = (const int32_t *)(xq + (int64_t)(m0 + m) * K);
    const uint8_t *block[NB];
    for (int b = 0; b < NB; b++) block[b] = packed + (b0 + b) * (K / 4) * stride;
    __m512 total[MR][NB];
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++) total[m][b] = _mm512_setzero_ps();
    for (int a = 0, g = 0, in_group = 0; a < A; a++) {
        __m512i dot[MR][NB];
        for (int m = 0; m < MR; m++)
            for (int b = 0; b < NB; b++) dot[m][b] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 8 * a; j < 8 * a + 8; j++) {
            for (int b = 0; b < NB; b++) {
                const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block[b] + j * 32)));
                __m512i q = _mm512_ternarylogic_epi32(words, _mm512_slli_epi16(words, 4), nibbles, 0xA8);
                if (BITS == 5) /* the mask straight from memory (a load, not a shuffle-port move), one masked add */
                    q = _mm512_mask_add_epi8(q, _load_mask64((__mmask64 *)(block[b] + (K / 4) * 32 + j * 8)), q,
                                             sixteen);
                for (int m = 0; m < MR; m++) dot[m][b] = _mm512_dpbusd_epi32(dot[m][b], q, _mm512_set1_epi32(xr[m][j]));
            }
        }
        if (a && ++in_group == per_group) g++, in_group = 0; /* g = a * 32 / group, without a division */
        if (AHEAD)
            for (int b = NB; b < 2 * NB; b++) {
                const uint8_t *next = packed + (b0 + b) * (K / 4) * stride;
                fetch(next + a * 256, 256);
                if (BITS == 5) fetch(next + (K / 4) * 32 + a * 64, 64);
                fetch(scales + (((b0 + b) * G + g) * 2) * 16, 64);
            }
        for (int b = 0; b < NB; b++) {
            const uint16_t *sz = scales + (((b0 + b) * G + g) * 2) * 16;
            const __m512 s = load16_bf16(sz), shift = _mm512_fmadd_ps(minus_offset, s, load16_bf16(sz + 16));
            for (int m = 0; m < MR; m++) {
                const int64_t at = (int64_t)(m0 + m) * A + a;
                const __m512 ds = _mm512_mul_ps(s, _mm512_set1_ps(xd[at]));
                total[m][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][b]), ds, total[m][b]);
                total[m][b] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[at]), shift, total[m][b]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++)
            _mm256_storeu_si256((__m256i *)(y + (int64_t)(m0 + m) * N + (b0 + b) * 16),
                                (__m256i)_mm512_cvtneps_pbh(total[m][b]));
}

/* 8-bit weights, int8 activations. Layout [N/16][K/4][64] bytes (int8_pack with int8_rows): byte 4c + t of (block
 * b, quad j) is q[16b + c, 4j + (0, 2, 1, 3)[t]] + 128, unsigned as vpdpbusd takes it, so
 *     sum_k x[k] w[n, k] = scale[n] * (sum_a d_a sum_k xq[k] (q[k] + 128) - xbias),
 * xbias = sum_a d_a 128 sum_k xq[k] (quantize_rows, per row). */
ALWAYS_INLINE void tile8_i8(const uint8_t *packed, const float *scales, const int8_t *xq, const float *xd,
                            const float *xbias, uint16_t *y, int64_t b0, int m0, int K, int N, const int MR,
                            const int NB, const int AHEAD) {
    const int A = K / 32;
    const int32_t *xr[MR]; /* as tile4_i8: hoisted, the quads unrolled */
    for (int m = 0; m < MR; m++) xr[m] = (const int32_t *)(xq + (int64_t)(m0 + m) * K);
    __m512 total[MR][NB];
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++) total[m][b] = _mm512_setzero_ps();
    for (int a = 0; a < A; a++) {
        __m512i dot[MR][NB];
        for (int m = 0; m < MR; m++)
            for (int b = 0; b < NB; b++) dot[m][b] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 8 * a; j < 8 * a + 8; j++)
            for (int b = 0; b < NB; b++) {
                const __m512i q = _mm512_loadu_si512(packed + ((b0 + b) * (K / 4) + j) * 64);
                for (int m = 0; m < MR; m++) dot[m][b] = _mm512_dpbusd_epi32(dot[m][b], q, _mm512_set1_epi32(xr[m][j]));
            }
        if (AHEAD)
            for (int b = NB; b < 2 * NB; b++) {
                fetch(packed + ((b0 + b) * (K / 4) + 8 * a) * 64, 512);
                if (a == 0) fetch(scales + (b0 + b) * 16, 64);
            }
        for (int m = 0; m < MR; m++) {
            const __m512 d = _mm512_set1_ps(xd[(int64_t)(m0 + m) * A + a]);
            for (int b = 0; b < NB; b++) total[m][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][b]), d, total[m][b]);
        }
    }
    for (int b = 0; b < NB; b++) {
        const __m512 s = _mm512_loadu_ps(scales + (b0 + b) * 16);
        for (int m = 0; m < MR; m++) {
            const __m512 sum = _mm512_sub_ps(total[m][b], _mm512_set1_ps(xbias[m0 + m]));
            _mm256_storeu_si256((__m256i *)(y + (int64_t)(m0 + m) * N + (b0 + b) * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sum, s)));
        }
    }
}

/* 8-bit weights in groups of GROUP = 32 (GGUF's Q8_0, Q5_0, Q5_1 and Q5_K held as int8) or 16 (Q6_K),
 * int8 activations: tile8_i8's packed bytes (q + 128, unsigned), tile4_i8's scales and zeros per group.
 * With w = q * scale + zero, per group
 *     sum_k x[k] w[n, k] = scale * (d sum_k xq[k] (q[k] + 128) - 128 xqsum) + zero * xsum
 * where xqsum = d sum_k xq[k] cancels the offset exactly (the integer sums are exact) and xsum is the
 * sum of the unrounded x, as tile4_i8's; both per group (quantize_rows' sums16 for groups of 16). */
ALWAYS_INLINE void tile8g_i8(const uint8_t *packed, const uint16_t *scales, const int8_t *xq, const float *xd,
                             const float *xsum, const float *xqsum, uint16_t *y, int64_t b0, int m0, int K, int G,
                             int N, const int MR, const int NB, const int GROUP, const int AHEAD) {
    const int A = K / 32, H = 32 / GROUP; /* groups per 32 inputs */
    const int32_t *xr[MR]; /* as tile4_i8: hoisted, the quads unrolled */
    for (int m = 0; m < MR; m++) xr[m] = (const int32_t *)(xq + (int64_t)(m0 + m) * K);
    __m512 total[MR][NB];
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++) total[m][b] = _mm512_setzero_ps();
    for (int a = 0; a < A; a++)
        for (int h = 0; h < H; h++) {
            __m512i dot[MR][NB];
            for (int m = 0; m < MR; m++)
                for (int b = 0; b < NB; b++) dot[m][b] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int j = 8 * a + h * 8 / H; j < 8 * a + (h + 1) * 8 / H; j++)
                for (int b = 0; b < NB; b++) {
                    const __m512i q = _mm512_loadu_si512(packed + ((b0 + b) * (K / 4) + j) * 64);
                    for (int m = 0; m < MR; m++)
                        dot[m][b] = _mm512_dpbusd_epi32(dot[m][b], q, _mm512_set1_epi32(xr[m][j]));
                }
            const int g = a * H + h;
            if (AHEAD)
                for (int b = NB; b < 2 * NB; b++) {
                    fetch(packed + ((b0 + b) * (K / 4) + 8 * a + h * 8 / H) * 64, 512 / H);
                    fetch(scales + (((b0 + b) * G + g) * 2) * 16, 64);
                }
            for (int b = 0; b < NB; b++) {
                const uint16_t *sz = scales + (((b0 + b) * G + g) * 2) * 16;
                const __m512 s = load16_bf16(sz), z = load16_bf16(sz + 16);
                for (int m = 0; m < MR; m++) {
                    const int64_t at = (int64_t)(m0 + m) * G + g;
                    const __m512 own = _mm512_fmsub_ps(_mm512_cvtepi32_ps(dot[m][b]),
                                                       _mm512_set1_ps(xd[(int64_t)(m0 + m) * A + a]),
                                                       _mm512_set1_ps(128.f * xqsum[at]));
                    total[m][b] = _mm512_fmadd_ps(own, s, total[m][b]);
                    total[m][b] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[at]), z, total[m][b]);
                }
            }
        }
    for (int m = 0; m < MR; m++)
        for (int b = 0; b < NB; b++)
            _mm256_storeu_si256((__m256i *)(y + (int64_t)(m0 + m) * N + (b0 + b) * 16),
                                (__m256i)_mm512_cvtneps_pbh(total[m][b]));
}

struct rows_job {
    const uint16_t *x;
    int8_t *xq;
    float *xd, *xsum, *xbias, *xqsum; /* xbias: NULL, or tile8_i8's per row; xqsum: NULL, or tile8g_i8's */
    int M, K, sums16; /* sums16: xsum and xqsum per 16 inputs (tile8g_i8 in groups of 16) */
};

/* Rows of x to int8 per 32 inputs: xq (each quad's k in the order 0, 2, 1, 3, as tile4_i8 reads the
 * nibbles), xd the step d, xsum the sum of the unrounded inputs, xbias (if wanted) tile8_i8's, xqsum (if
 * wanted) d times the sum of xq per 32 inputs, tile8g_i8's. Round to nearest even. */
static void quantize_rows(void *ctx, int part, int parts) {
    const struct rows_job *j = ctx;
    const __m512i quads = _mm512_set_epi32(15, 13, 14, 12, 11, 9, 10, 8, 7, 5, 6, 4, 3, 1, 2, 0);
    const int A = j->K / 32;
    for (int64_t m = pool_share(j->M, part, parts); m < pool_share(j->M, part + 1, parts); m++) {
        float bias = 0.f;
        for (int a = 0; a < A; a++) {
            const int64_t at = m * A + a, k = m * j->K + 32 * a;
            const __m512 lo = load16_bf16(j->x + k), hi = load16_bf16(j->x + k + 16);
            const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
            j->xd[at] = top / 127.f;
            const __m512i qlo = _mm512_permutexvar_epi32(quads, _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)));
            const __m512i qhi = _mm512_permutexvar_epi32(quads, _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv)));
            _mm_storeu_si128((__m128i *)(j->xq + k), _mm512_cvtepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(j->xq + k + 16), _mm512_cvtepi32_epi8(qhi));
            const float rounded = j->xd[at] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
            bias += 128.f * rounded;
            if (j->sums16) { /* per half: the sums of its 16 inputs, unrounded and rounded */
                j->xsum[2 * at] = _mm512_reduce_add_ps(lo), j->xsum[2 * at + 1] = _mm512_reduce_add_ps(hi);
                j->xqsum[2 * at] = j->xd[at] * (float)_mm512_reduce_add_epi32(qlo);
                j->xqsum[2 * at + 1] = j->xd[at] * (float)_mm512_reduce_add_epi32(qhi);
            } else {
                j->xsum[at] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
                if (j->xqsum) j->xqsum[at] = rounded;
            }
        }
        if (j->xbias) j->xbias[m] = bias;
    }
}

#endif
