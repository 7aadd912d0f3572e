/* Decode attention's two passes for fp32 caches on AVX2 with FMA (paged_attention.c's plain path
 * walks K and V a token at a time, one horizontal sum per token and query row, and keeps the
 * outputs in memory): scores come 16 tokens at a time, across tokens (K lies in dimension pairs), and
 * the outputs of up to 3 query rows of a kv head stay in registers while V streams by.
 * Needs D % 32 == 0 and block_size % 16 == 0 (16 tokens never straddle a block).
 * Measured (the default model in fp32, an AMD EPYC without AVX-512): attention per decode step at batch 8
 * 9.0 -> 5.5 ms, at batch 64 17.4 -> 13.3 ms; with it the shared-prefix cascade no longer pays there.
 * With K in pairs (2026-12-02, an AVX-512 EPYC, attention alone at 64 rows, fp32): 1.78-2.12 ms against
 * 1.91-2.04 summing per token (8-token tiles of 6 sums for 3 rows lost: 1.84-2.28). */
#pragma once
#include "common.h"

#ifdef PC_AVX2_FMA
#include <immintrin.h>
#include <stdint.h>

/* Scores of ROWS (1-3, a constant at each call) query rows of one kv head for 16 tokens of one block,
 * K laid out as dimension pairs ([Hkv, D/2, block_size, 2] a block; k at pair 0 of the first token):
 * one vector holds one pair of 4 tokens and meets each row's pair, broadcast, in one FMA (12
 * independent sums for 3 rows, enough to cover the FMA's latency); the two lanes of each token are
 * added once at the end. q: the rows' K-sized rows, D apart. */
ALWAYS_INLINE void scores_rows_f32(const float *k, int64_t pair_stride,
                                                                  const float *q, int D, const int ROWS,
                                                                  float scale, float *out, int64_t L, int n) {
    __m256 a[3][4];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();
    for (int p = 0; p < D / 2; p++) {
        __m256 qp[3];
        for (int r = 0; r < ROWS; r++) /* the row's pair (q[2p], q[2p + 1]) in every 64-bit lane */
            qp[r] = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(q + r * D + 2 * p)));
        for (int j = 0; j < 4; j++) {
            const __m256 x = _mm256_loadu_ps(k + p * pair_stride + 8 * j);
            for (int r = 0; r < ROWS; r++) a[r][j] = _mm256_fmadd_ps(qp[r], x, a[r][j]);
        }
    }
    for (int r = 0; r < ROWS; r++) {
        float v[16];
        for (int h = 0; h < 2; h++) { /* hadd leaves tokens 0 1 4 5 | 2 3 6 7: the 64-bit lanes reordered */
            const __m256 sums = _mm256_hadd_ps(a[r][2 * h], a[r][2 * h + 1]);
            const __m256d s = _mm256_permute4x64_pd(_mm256_castps_pd(sums), _MM_SHUFFLE(3, 1, 2, 0));
            _mm256_storeu_ps(v + 8 * h, _mm256_mul_ps(_mm256_castpd_ps(s), _mm256_set1_ps(scale)));
        }
        for (int i = 0; i < n; i++) out[r * L + i] = v[i];
    }
}

/* Pass 1: scores [R, L] of the R = nh * G query rows qf [R, D] against kv heads [h0, h0 + nh). */
static void scores_f32(const float *qf, const float *k_cache, const int64_t *table, int64_t L, int h0, int nh,
                       int G, int Hkv, int D, int block_size, float scale, float *scores) {
    const int64_t head = (int64_t)D * block_size;
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int n = L - t0 < 16 ? (int)(L - t0) : 16; /* past the end: the block's slots, scores not stored */
        const float *b = k_cache + table[t0 / block_size] * Hkv * head + t0 % block_size * 2;
        for (int hh = 0; hh < nh; hh++)
            for (int g = hh * G; g < (hh + 1) * G; g += 3) {
                const float *k = b + (h0 + hh) * head, *q = qf + (int64_t)g * D;
                float *out = scores + (size_t)g * L + t0;
                switch ((hh + 1) * G - g) {
                case 1: scores_rows_f32(k, 2 * block_size, q, D, 1, scale, out, L, n); break;
                case 2: scores_rows_f32(k, 2 * block_size, q, D, 2, scale, out, L, n); break;
                default: scores_rows_f32(k, 2 * block_size, q, D, 3, scale, out, L, n); break;
                }
            }
    }
}

/* Pass 2 for ROWS (1-3, a constant at each call) query rows of one kv head and 32 of their output
 * dimensions: acc [ROWS][32] += p[row, t] * V[t] over the head's tokens. */
ALWAYS_INLINE void values_rows_f32(const float *v_head, const int64_t *table,
                                                                  int64_t L, int64_t stride, int block_size,
                                                                  const float *p, int64_t L_p, const int ROWS,
                                                                  float *out, int D) {
    __m256 a[3][4];
    for (int g = 0; g < ROWS; g++)
        for (int j = 0; j < 4; j++) a[g][j] = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const int n = L - t0 < block_size ? (int)(L - t0) : block_size;
        const float *v0 = v_head + table[t0 / block_size] * block_size * stride;
        for (int t = 0; t < n; t++) {
            const float *vt = v0 + t * stride;
            const __m256 w[4] = {_mm256_loadu_ps(vt), _mm256_loadu_ps(vt + 8), _mm256_loadu_ps(vt + 16),
                                 _mm256_loadu_ps(vt + 24)};
            for (int g = 0; g < ROWS; g++) {
                const __m256 pt = _mm256_broadcast_ss(p + g * L_p + t0 + t);
                for (int j = 0; j < 4; j++) a[g][j] = _mm256_fmadd_ps(pt, w[j], a[g][j]);
            }
        }
    }
    for (int g = 0; g < ROWS; g++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + g * D + 8 * j, a[g][j]);
}

/* Pass 2: acc [R, D] = probabilities [R, L] times V, kv heads [h0, h0 + nh). */
static void values_f32(const float *v_cache, const int64_t *table, int64_t L, int h0, int nh, int G, int Hkv,
                       int D, int block_size, const float *probs, float *acc) {
    const int64_t stride = (int64_t)Hkv * D;
    for (int hh = 0; hh < nh; hh++)
        for (int d0 = 0; d0 < D; d0 += 32) {
            const float *v_head = v_cache + (int64_t)(h0 + hh) * D + d0;
            for (int g = hh * G; g < (hh + 1) * G; g += 3) {
                const float *p = probs + (int64_t)g * L;
                float *out = acc + (int64_t)g * D + d0;
                switch ((hh + 1) * G - g) {
                case 1: values_rows_f32(v_head, table, L, stride, block_size, p, L, 1, out, D); break;
                case 2: values_rows_f32(v_head, table, L, stride, block_size, p, L, 2, out, D); break;
                default: values_rows_f32(v_head, table, L, stride, block_size, p, L, 3, out, D); break;
                }
            }
        }
}
#endif
