/* Decode attention's two passes for fp32 caches on AVX2 with FMA (paged_attention.c's plain path
 * walked K and V a token at a time, one horizontal sum per token and query row, and kept the
 * outputs in memory): scores come 8 tokens at a time from 8 accumulators summed by one transpose
 * tree, and the outputs of up to 3 query rows of a kv head stay in registers while V streams by.
 * Needs D % 32 == 0 and block_size % 8 == 0 (8 tokens never straddle a block).
 * Measured (the default model in fp32, an AMD EPYC without AVX-512): attention per decode step at batch 8
 * 9.0 -> 5.5 ms, at batch 64 17.4 -> 13.3 ms; with it the shared-prefix cascade no longer pays there. */
#pragma once
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <stdint.h>

/* v[0..7] -> one vector whose lane i is the sum of v[i]'s lanes. */
static inline __m256 sum8_f32(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d); /* per 128-bit half: 4 partial sums */
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* Pass 1: scores [R, L] of the R = nh * G query rows qf [R, D] against kv heads [h0, h0 + nh). */
static void scores_f32(const float *qf, const float *k_cache, const int64_t *table, int64_t L, int h0, int nh,
                       int G, int Hkv, int D, int block_size, float scale, float *scores) {
    const int64_t stride = (int64_t)Hkv * D; /* one token to the next in a block */
    for (int64_t t0 = 0; t0 < L; t0 += 8) {
        const int n = L - t0 < 8 ? (int)(L - t0) : 8;
        const int64_t slot = table[t0 / block_size] * block_size + t0 % block_size;
        int64_t off[8]; /* past the end: the last token again, its score not stored */
        for (int i = 0; i < 8; i++) off[i] = (i < n ? i : n - 1) * stride;
        for (int r = 0; r < nh * G; r++) {
            const float *k0 = k_cache + (slot * Hkv + h0 + r / G) * D, *qr = qf + (int64_t)r * D;
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qr + d);
                for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + off[i] + d), acc[i]);
            }
            float s[8];
            _mm256_storeu_ps(s, _mm256_mul_ps(sum8_f32(acc), _mm256_set1_ps(scale)));
            for (int i = 0; i < n; i++) scores[(size_t)r * L + t0 + i] = s[i];
        }
    }
}

/* Pass 2 for ROWS (1-3, a constant at each call) query rows of one kv head and 32 of their output
 * dimensions: acc [ROWS][32] += p[row, t] * V[t] over the head's tokens. */
static inline __attribute__((always_inline)) void values_rows_f32(const float *v_head, const int64_t *table,
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
