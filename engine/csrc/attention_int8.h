/* Decode attention's two passes over int8 caches (--kv-cache-dtype int8), and the store that fills them.
 * Each token's K and V row of each kv head is rounded to int8 with its own scale, max |x| / 127 (round to
 * nearest even), so a block holds about half the bytes of bf16, a quarter of fp32's.
 *
 * A block of one layer's K pool: the int8 values in dimension quads ([Hkv, D/4, block_size, 4]: one
 * 64-byte load holds a quad of 16 tokens) then their scales ([Hkv, block_size] fp32); of the V pool: values
 * [block_size, Hkv, D] then scales [block_size, Hkv] fp32 (engine/kv_layout.py's int8_views: the same bytes).
 * Scores: each query row is rounded to int8 too (its own scale, as llama.cpp's Q8 rows meet a Q8 cache),
 * and a quad of tokens meets each row's quad in integer dot products: lane t sums token t's products, no
 * sum across lanes; then lane t is scaled by token t's scale. Values: each token's row widened to fp32
 * meets each query row's probability times the token's scale.
 * Two builds of the passes: bf16 queries on AVX-512 BF16 and VNNI (vpdpbusd, K's bytes offset by 128 to
 * be unsigned, the offset taken out exactly by the row's integer sum; up to 4 rows' outputs of 64
 * dimensions in registers), and fp32 queries on AVX2 (vpmaddubsw, below). */
#pragma once
#include <math.h>
#include "common.h"

#include <stdint.h>

/* Bytes of one block of one layer's K (or V) pool in int8. */
static inline int64_t int8_block_bytes(int Hkv, int D, int block_size) {
    return (int64_t)Hkv * block_size * (D + 4);
}

/* The query rows of one task as int8: quads [R, D/4] (int32 each), and per row its scale times the
 * softmax scale and 128 times its integer sum (the K offset's share; AVX-512 only). */
struct int8_queries {
    const int32_t *quads;
    const float *scale, *offset;
};

#ifdef PC_AVX512_BF16_VNNI
#include <immintrin.h>

/* Scores of `rows` (at most 4, a constant where called) query rows of one kv head for 16 tokens. */
ALWAYS_INLINE void scores_int8_rows(const int8_t *k, int block_size, const struct int8_queries *iq, int g, int D,
                                    int rows, __m512 token_scales, float *out, int64_t L, int n) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i a[4];
    for (int r = 0; r < rows; r++) a[r] = _mm512_setzero_si512();
    for (int p = 0; p < D / 4; p++) {
        const __m512i kx = _mm512_xor_si512(_mm512_loadu_si512(k + p * 4 * block_size), flip);
        for (int r = 0; r < rows; r++)
            a[r] = _mm512_dpbusd_epi32(a[r], kx, _mm512_set1_epi32(iq->quads[(g + r) * (D / 4) + p]));
    }
    for (int r = 0; r < rows; r++) {
        const __m512 sums = _mm512_sub_ps(_mm512_cvtepi32_ps(a[r]), _mm512_set1_ps(iq->offset[g + r]));
        _mm512_mask_storeu_ps(out + r * L, (__mmask16)((1u << n) - 1),
                              _mm512_mul_ps(_mm512_mul_ps(sums, _mm512_set1_ps(iq->scale[g + r])), token_scales));
    }
}

/* Scores [R, L] of the task's R = nh * G query rows against kv heads [h0, h0 + nh), 16 tokens at a time
 * (block_size % 16 == 0: they never straddle a block). */
static void scores_int8(const struct int8_queries *iq, const uint8_t *k_pool, const int64_t *table, int64_t L,
                        int h0, int nh, int G, int Hkv, int D, int block_size, float *scores) {
    const int64_t block_bytes = int8_block_bytes(Hkv, D, block_size), head = (int64_t)D * block_size;
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int n = L - t0 < 16 ? (int)(L - t0) : 16;
        const uint8_t *block = k_pool + table[t0 / block_size] * block_bytes;
        const int within = (int)(t0 % block_size);
        if (within == 0 && t0 + block_size < L) /* blocks lie anywhere: fetch the next one's K while this one's run */
            prefetch_span(k_pool + table[t0 / block_size + 1] * block_bytes + h0 * head, nh * head);
        for (int hh = 0; hh < nh; hh++) {
            const int8_t *k = (const int8_t *)block + (h0 + hh) * head + within * 4;
            const __m512 token_scales = _mm512_loadu_ps((const float *)(block + (int64_t)Hkv * head) +
                                                        (int64_t)(h0 + hh) * block_size + within);
            for (int g = hh * G; g < (hh + 1) * G; g += 4) {
                float *out = scores + (size_t)g * L + t0;
                switch ((hh + 1) * G - g) {
                case 1: scores_int8_rows(k, block_size, iq, g, D, 1, token_scales, out, L, n); break;
                case 2: scores_int8_rows(k, block_size, iq, g, D, 2, token_scales, out, L, n); break;
                case 3: scores_int8_rows(k, block_size, iq, g, D, 3, token_scales, out, L, n); break;
                default: scores_int8_rows(k, block_size, iq, g, D, 4, token_scales, out, L, n); break;
                }
            }
        }
    }
}

/* acc for `rows` (at most 4) query rows of kv head h, dimensions [d0, d0 + 16 * chunks) (chunks at most
 * 4; both constants where called): the probabilities p (unnormalised, L apart) times V. */
ALWAYS_INLINE void values_int8_rows(const uint8_t *v_pool, const int64_t *table, int64_t L, int Hkv, int D,
                                    int block_size, int h, int d0, const float *p, int rows, int chunks, float *acc) {
    const int64_t block_bytes = int8_block_bytes(Hkv, D, block_size);
    __m512 a[4][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++) a[r][c] = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const uint8_t *block = v_pool + table[t0 / block_size] * block_bytes;
        const int8_t *values = (const int8_t *)block + (int64_t)h * D + d0;
        const float *scales = (const float *)(block + (int64_t)block_size * Hkv * D) + h;
        const int n = L - t0 < block_size ? (int)(L - t0) : block_size;
        if (t0 + block_size < L) { /* the next block's rows of this head while this one's run */
            const int8_t *next = (const int8_t *)(v_pool + table[t0 / block_size + 1] * block_bytes) + (int64_t)h * D + d0;
            for (int t = 0; t < block_size; t++) prefetch_span(next + (int64_t)t * Hkv * D, 16 * chunks);
        }
        for (int t = 0; t < n; t++) {
            __m512 v[4];
            for (int c = 0; c < chunks; c++)
                v[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(values + (int64_t)t * Hkv * D + 16 * c))));
            for (int r = 0; r < rows; r++) {
                const __m512 w = _mm512_set1_ps(p[r * L + t0 + t] * scales[t * Hkv]);
                for (int c = 0; c < chunks; c++) a[r][c] = _mm512_fmadd_ps(w, v[c], a[r][c]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(acc + r * D + d0 + 16 * c, a[r][c]);
}

/* acc [R, D] = the probabilities [R, L] (unnormalised) times V of kv heads [h0, h0 + nh); D % 16 == 0. */
static void values_int8(const uint8_t *v_pool, const int64_t *table, int64_t L, int h0, int nh, int G, int Hkv,
                        int D, int block_size, const float *probs, float *acc) {
    for (int hh = 0; hh < nh; hh++)
        for (int g = hh * G; g < (hh + 1) * G; g += 4)
            for (int d0 = 0; d0 < D; d0 += 64) {
                const int rows = (hh + 1) * G - g < 4 ? (hh + 1) * G - g : 4, chunks = D - d0 < 64 ? (D - d0) / 16 : 4;
#define VALUES(R, C) values_int8_rows(v_pool, table, L, Hkv, D, block_size, h0 + hh, d0, probs + (size_t)g * L, R, C, \
                                      acc + g * D)
#define VALUES_ROWS(R) switch (chunks) { case 1: VALUES(R, 1); break; case 2: VALUES(R, 2); break; \
                                         case 3: VALUES(R, 3); break; default: VALUES(R, 4); break; }
                switch (rows) {
                case 1: VALUES_ROWS(1); break;
                case 2: VALUES_ROWS(2); break;
                case 3: VALUES_ROWS(3); break;
                default: VALUES_ROWS(4); break;
                }
#undef VALUES_ROWS
#undef VALUES
            }
}
#endif

#ifdef PC_AVX2_FMA
#include <immintrin.h>

/* AVX2's scores of `rows` (at most 3, a constant where called) query rows of one kv head for 16 tokens.
 * vpmaddubsw multiplies unsigned bytes by signed ones and saturates its pair sums at 16 bits, so K's
 * bytes offset by 128 would overflow (2 * 255 * 127); |k| meets the query byte given k's sign (vpsignb)
 * instead: pairs of at most 2 * 127 * 127, exact; vpmaddwd by ones then sums each token's quad. */
ALWAYS_INLINE void scores_int8_rows_avx2(const int8_t *k, int block_size, const struct int8_queries *iq, int g,
                                         int D, int rows, const float *token_scales, float *out, int64_t L, int n) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a[3][2];
    for (int r = 0; r < rows; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
    for (int p = 0; p < D / 4; p++) {
        const __m256i k0 = _mm256_loadu_si256((const __m256i *)(k + p * 4 * block_size));
        const __m256i k1 = _mm256_loadu_si256((const __m256i *)(k + p * 4 * block_size + 32));
        const __m256i m0 = _mm256_abs_epi8(k0), m1 = _mm256_abs_epi8(k1);
        for (int r = 0; r < rows; r++) {
            const __m256i qr = _mm256_set1_epi32(iq->quads[(g + r) * (D / 4) + p]);
            a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(m0, _mm256_sign_epi8(qr, k0)), ones));
            a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(m1, _mm256_sign_epi8(qr, k1)), ones));
        }
    }
    const __m256 s0 = _mm256_loadu_ps(token_scales), s1 = _mm256_loadu_ps(token_scales + 8);
    for (int r = 0; r < rows; r++) { /* slots past the sequence's end hold anything: never stored */
        const __m256 row_scale = _mm256_set1_ps(iq->scale[g + r]);
        float v[16];
        _mm256_storeu_ps(v, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a[r][0]), row_scale), s0));
        _mm256_storeu_ps(v + 8, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a[r][1]), row_scale), s1));
        memcpy(out + r * L, v, sizeof(float) * n);
    }
}

/* scores_int8's AVX2 build: the same walk, 3 rows at a time. */
static void scores_int8_avx2(const struct int8_queries *iq, const uint8_t *k_pool, const int64_t *table, int64_t L,
                             int h0, int nh, int G, int Hkv, int D, int block_size, float *scores) {
    const int64_t block_bytes = int8_block_bytes(Hkv, D, block_size), head = (int64_t)D * block_size;
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int n = L - t0 < 16 ? (int)(L - t0) : 16;
        const uint8_t *block = k_pool + table[t0 / block_size] * block_bytes;
        const int within = (int)(t0 % block_size);
        if (within == 0 && t0 + block_size < L)
            prefetch_span(k_pool + table[t0 / block_size + 1] * block_bytes + h0 * head, nh * head);
        for (int hh = 0; hh < nh; hh++) {
            const int8_t *k = (const int8_t *)block + (h0 + hh) * head + within * 4;
            const float *token_scales = (const float *)(block + (int64_t)Hkv * head) + (int64_t)(h0 + hh) * block_size + within;
            for (int g = hh * G; g < (hh + 1) * G; g += 3) {
                float *out = scores + (size_t)g * L + t0;
                switch ((hh + 1) * G - g) {
                case 1: scores_int8_rows_avx2(k, block_size, iq, g, D, 1, token_scales, out, L, n); break;
                case 2: scores_int8_rows_avx2(k, block_size, iq, g, D, 2, token_scales, out, L, n); break;
                default: scores_int8_rows_avx2(k, block_size, iq, g, D, 3, token_scales, out, L, n); break;
                }
            }
        }
    }
}

/* AVX2's acc for `rows` (at most 3) query rows of kv head h, dimensions [d0, d0 + 8 * chunks) (chunks at
 * most 4; both constants where called): 12 sums and 4 widened V vectors fill the 16 registers. */
ALWAYS_INLINE void values_int8_rows_avx2(const uint8_t *v_pool, const int64_t *table, int64_t L, int Hkv, int D,
                                         int block_size, int h, int d0, const float *p, int rows, int chunks,
                                         float *acc) {
    const int64_t block_bytes = int8_block_bytes(Hkv, D, block_size);
    __m256 a[3][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++) a[r][c] = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const uint8_t *block = v_pool + table[t0 / block_size] * block_bytes;
        const int8_t *values = (const int8_t *)block + (int64_t)h * D + d0;
        const float *scales = (const float *)(block + (int64_t)block_size * Hkv * D) + h;
        const int n = L - t0 < block_size ? (int)(L - t0) : block_size;
        if (t0 + block_size < L) {
            const int8_t *next = (const int8_t *)(v_pool + table[t0 / block_size + 1] * block_bytes) + (int64_t)h * D + d0;
            for (int t = 0; t < block_size; t++) prefetch_span(next + (int64_t)t * Hkv * D, 8 * chunks);
        }
        for (int t = 0; t < n; t++) {
            __m256 v[4];
            for (int c = 0; c < chunks; c++)
                v[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(values + (int64_t)t * Hkv * D + 8 * c))));
            for (int r = 0; r < rows; r++) {
                const __m256 w = _mm256_set1_ps(p[r * L + t0 + t] * scales[t * Hkv]);
                for (int c = 0; c < chunks; c++) a[r][c] = _mm256_fmadd_ps(w, v[c], a[r][c]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++) _mm256_storeu_ps(acc + r * D + d0 + 8 * c, a[r][c]);
}

/* values_int8's AVX2 build; D % 8 == 0. */
static void values_int8_avx2(const uint8_t *v_pool, const int64_t *table, int64_t L, int h0, int nh, int G, int Hkv,
                             int D, int block_size, const float *probs, float *acc) {
    for (int hh = 0; hh < nh; hh++)
        for (int g = hh * G; g < (hh + 1) * G; g += 3)
            for (int d0 = 0; d0 < D; d0 += 32) {
                const int rows = (hh + 1) * G - g < 3 ? (hh + 1) * G - g : 3, chunks = D - d0 < 32 ? (D - d0) / 8 : 4;
#define VALUES(R, C) values_int8_rows_avx2(v_pool, table, L, Hkv, D, block_size, h0 + hh, d0, probs + (size_t)g * L, \
                                           R, C, acc + g * D)
#define VALUES_ROWS(R) switch (chunks) { case 1: VALUES(R, 1); break; case 2: VALUES(R, 2); break; \
                                         case 3: VALUES(R, 3); break; default: VALUES(R, 4); break; }
                switch (rows) {
                case 1: VALUES_ROWS(1); break;
                case 2: VALUES_ROWS(2); break;
                default: VALUES_ROWS(3); break;
                }
#undef VALUES_ROWS
#undef VALUES
            }
}
#endif

/* One token's row of one head (D <= 512 values, fp32 or bf16 bits) to int8 and its scale, max |x| / 127;
 * round to nearest even, as torch.round. */
static inline float quantize_head(const void *x, int dtype, int D, int8_t *out) {
    float top = 0.f, v[512];
    for (int d = 0; d < D; d++) {
        v[d] = dtype == 0 ? ((const float *)x)[d] : bf16_to_f32(((const uint16_t *)x)[d]);
        top = fabsf(v[d]) > top ? fabsf(v[d]) : top;
    }
    const float inv = top > 0.f ? 127.f / top : 0.f;
    for (int d = 0; d < D; d++) out[d] = (int8_t)rintf(v[d] * inv);
    return top / 127.f;
}
