/* Decode attention's two passes over int8 caches (--kv-cache-dtype int8), bf16 queries, AVX-512 BF16 and
 * VNNI, and the store that fills them. Each token's K and V row of each kv head is rounded to int8 with its
 * own scale, max |x| / 127 (round to nearest even), so a block holds about half the bytes of bf16.
 *
 * A block of one layer's K pool: the int8 values in dimension quads ([Hkv, D/4, block_size, 4]: one
 * 64-byte load holds a quad of 16 tokens) then their scales ([Hkv, block_size] fp32); of the V pool: values
 * [block_size, Hkv, D] then scales [block_size, Hkv] fp32 (engine/kv_layout.py's int8_views: the same bytes).
 * Scores: each query row is rounded to int8 too (its own scale, as llama.cpp's Q8 rows meet a Q8 cache),
 * and a quad of 16 tokens meets each row's quad in one vpdpbusd (K's bytes offset by 128 to be unsigned,
 * the offset taken out exactly by the row's integer sum): lane t sums token t's products, no sum across
 * lanes; then lane t is scaled by token t's scale. Values: each token's row widened to fp32 meets each
 * query row's probability times the token's scale; up to 4 rows' outputs of 64 dimensions stay in registers. */
#pragma once
#include <math.h>
#include "common.h"

#ifdef PC_AVX512_BF16_VNNI
#include <immintrin.h>
#include <stdint.h>

/* Bytes of one block of one layer's K (or V) pool in int8. */
static inline int64_t int8_block_bytes(int Hkv, int D, int block_size) {
    return (int64_t)Hkv * block_size * (D + 4);
}

/* The query rows of one task as int8: quads [R, D/4] (int32 each), and per row its scale times the
 * softmax scale and 128 times its integer sum (the K offset's share). */
struct int8_queries {
    const int32_t *quads;
    const float *scale, *offset;
};

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
