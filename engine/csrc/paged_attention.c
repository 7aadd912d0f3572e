/* Paged decode attention for the CPU: one query token per sequence attends over its K/V, read in
 * place from the block pool through its block table (no gathered copy). Parallel over
 * (sequence, kv head); each task reads its K and V rows once. fp32 accumulation throughout.
 * K lies in dimension pairs so that scores vectorise across tokens: with AVX-512 BF16 (bf16 caches,
 * block_size % 16 == 0) 16 tokens' scores per bf16 pair dot product, fp32 on AVX2 4 per FMA; V lies
 * token by token, and for D == 64 the outputs stay in registers while V streams by; exp is
 * vectorised (exp.h). Where the CPU has AMX-BF16 (bf16 caches, D == 64), both passes run on AMX tiles
 * instead (attention_amx.h).
 *
 * Layouts (contiguous, except q's rows, q_stride elements apart, so q can be a view of the fused
 * qkv projection):
 *   q, out        [B, H, D]
 *   k cache       [num_blocks, Hkv, D/2, block_size, 2]
 *   v cache       [num_blocks, block_size, Hkv, D]
 *   block_tables  [B, max_blocks] int64, seq_lens [B] int64
 * dtype: 0 = float32, 1 = bfloat16 (q, cache and out share it); over int8 caches (attention_int8.h's
 * layouts, D % 16 == 0, block_size % 16 == 0): 2 = bfloat16 q and out (AVX-512 BF16 and VNNI), 3 = float32
 * q and out (AVX2 with FMA).
 *
 * With `starts` [B] int64, sequence b attends to tokens [starts[b], seq_lens[b]) only: a sliding
 * window (any token), or the cascade (a shared prefix attended elsewhere, once for all: multiples of
 * block_size). Where prefix_row[b] >= 0,
 * its result is merged exactly with the prefix's partial: prefix_out[prefix_row[b]] ([H, D] fp32,
 * normalised) and prefix_lse[prefix_row[b]] ([H], the log of its softmax denominator).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_f32.h"
#include "attention_int8.h"
#include "common.h"
#include "kernels.h"
#include "exp.h"
#include "pool.h"

/* A row's own attention, acc (D sums, unnormalised; its softmax's sum and maximum), merged exactly with
 * the shared prefix's partial (normalised, and the log of its denominator): acc becomes the result,
 * (own * sum_own + prefix * sum_prefix) / (sum_own + sum_prefix). */
static void merge_prefix(float *acc, float sum, float max, const float *prefix, float lse_pre, int D) {
    const float lse_own = max + logf(sum), inv = 1.f / sum;
    const float top = lse_own > lse_pre ? lse_own : lse_pre;
    const float w_own = exp_f32(lse_own - top), w_pre = exp_f32(lse_pre - top), norm = 1.f / (w_own + w_pre);
    for (int d = 0; d < D; d++) acc[d] = (acc[d] * inv * w_own + prefix[d] * w_pre) * norm;
}

#ifdef PC_AVX512_BF16
#include <immintrin.h>
#include "attention_amx.h"

/* Scores of `rows` query rows of one kv head (at most 4; a constant where it is called, so the loops
 * unroll) for 32 tokens: two runs of 16 in K's layout ([Hkv, D/2, block_size, 2] a block), k0 and
 * k1 at pair 0 of their first token. One 64-byte load holds one dimension pair of 16 tokens; it meets
 * each row's pair, broadcast, in one vdpbf16ps, so lane i accumulates token i's score: no sum across
 * lanes, and each K vector serves every query row of its head. q: the rows' pairs, `half` apart. */
ALWAYS_INLINE void scores_tile(const uint16_t *k0, const uint16_t *k1,
                                                              int64_t pair_stride, const uint32_t *q, int half,
                                                              int rows, float scale, float *out, int64_t L,
                                                              int n0, int n1) {
    __m512 a0[4], a1[4];
    for (int r = 0; r < rows; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int p = 0; p < half; p++) {
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512(k0 + p * pair_stride);
        const __m512bh x1 = (__m512bh)_mm512_loadu_si512(k1 + p * pair_stride);
        for (int r = 0; r < rows; r++) {
            const __m512bh qp = (__m512bh)_mm512_set1_epi32((int32_t)q[r * half + p]);
            a0[r] = _mm512_dpbf16_ps(a0[r], x0, qp);
            a1[r] = _mm512_dpbf16_ps(a1[r], x1, qp);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int r = 0; r < rows; r++) { /* lanes past the sequence's end are never stored */
        _mm512_mask_storeu_ps(out + r * L, (__mmask16)((1u << n0) - 1), _mm512_mul_ps(a0[r], s));
        if (n1) _mm512_mask_storeu_ps(out + r * L + 16, (__mmask16)((1u << n1) - 1), _mm512_mul_ps(a1[r], s));
    }
}

/* Pass 1 for bf16 with block_size % 16 == 0 (16 tokens never straddle a block): scores [R, L] of the
 * R = nh * G query rows q (D apart) against kv heads [h0, h0 + nh), 32 tokens at a time.
 * Measured (bench/attention.py, batch 64, 454 tokens each, the kernel threads): the whole kernel
 * 1.05 -> 0.70 ms a layer against K stored token by token (one sum tree per 16 tokens and row). */
static void scores_bf16(const uint16_t *q, const uint16_t *k_cache, const int64_t *table, int64_t L, int h0,
                        int nh, int G, int Hkv, int D, int block_size, float scale, float *scores) {
    const int half = D / 2;
    const int64_t head = (int64_t)D * block_size, pair_stride = 2 * block_size;
    for (int64_t t0 = 0; t0 < L; t0 += 32) {
        const int n0 = L - t0 < 16 ? (int)(L - t0) : 16;
        const int n1 = L - t0 <= 16 ? 0 : L - t0 < 32 ? (int)(L - t0 - 16) : 16;
        const int64_t t1 = n1 ? t0 + 16 : t0; /* no second run: the first again, its scores not stored */
        const uint16_t *b0 = k_cache + table[t0 / block_size] * Hkv * head + t0 % block_size * 2;
        const uint16_t *b1 = k_cache + table[t1 / block_size] * Hkv * head + t1 % block_size * 2;
        /* blocks lie anywhere: fetch the next 32 tokens' while these run */
        for (int64_t ahead = t0 + 32; ahead < t0 + 64 && ahead < L; ahead += block_size)
            if (ahead % block_size == 0) prefetch_span(k_cache + (table[ahead / block_size] * Hkv + h0) * head, nh * head * 2);
        for (int hh = 0; hh < nh; hh++) {
            const uint16_t *k0 = b0 + (h0 + hh) * head, *k1 = b1 + (h0 + hh) * head;
            for (int g = hh * G; g < (hh + 1) * G; g += 4) {
                const uint32_t *qg = (const uint32_t *)(q + (int64_t)g * D);
                float *out = scores + (size_t)g * L + t0;
                switch ((hh + 1) * G - g) {
                case 1: scores_tile(k0, k1, pair_stride, qg, half, 1, scale, out, L, n0, n1); break;
                case 2: scores_tile(k0, k1, pair_stride, qg, half, 2, scale, out, L, n0, n1); break;
                case 3: scores_tile(k0, k1, pair_stride, qg, half, 3, scale, out, L, n0, n1); break;
                default: scores_tile(k0, k1, pair_stride, qg, half, 4, scale, out, L, n0, n1); break;
                }
            }
        }
    }
}

/* Pass 2 for the same case with D == 64: the outputs of `rows` query rows of one kv head (at most
 * 4: 16 registers) stay in registers while the head's V rows stream by, two tokens at a time: their
 * rows interleaved into bf16 pairs meet each query row's two probabilities (rounded to bf16, as
 * flash attention does for its P.V product) in one pair dot product, fp32 accumulation. The pairs
 * leave the outputs' lanes in the order d = 8l + k (l a 128-bit lane) then 8l + 4 + k; they are put
 * back at the end. `rows` is a constant where it is called, so the loops over it unroll.
 * Measured (bench/attention.py, batch 64, with the kernel threads): 1.16 -> 0.69 ms a layer. */
ALWAYS_INLINE void values_d64_rows(const uint16_t *v_head, const int64_t *table,
                                                                  int64_t L, int Hkv, int block_size,
                                                                  const uint16_t *p, int64_t Lp, int rows,
                                                                  float *out) {
    __m512 a[4][4];
    for (int g = 0; g < rows; g++)
        for (int j = 0; j < 4; j++) a[g][j] = _mm512_setzero_ps();
    const int64_t stride = (int64_t)Hkv * 64;
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const int n = L - t0 < block_size ? (int)(L - t0) : block_size;
        const uint16_t *v0 = v_head + table[t0 / block_size] * block_size * stride;
        if (t0 + block_size < L) /* the next block's rows of this head while this one's run */
            for (int t = 0; t < block_size; t++) prefetch_span(v_head + (table[t0 / block_size + 1] * block_size + t) * stride, 128);
        for (int t = 0; t < n; t += 2) {
            const uint16_t *va = v0 + t * stride;
            const __m512i a0 = _mm512_loadu_si512(va), a1 = _mm512_loadu_si512(va + 32);
            __m512i b0 = _mm512_setzero_si512(), b1 = b0; /* past the end: zeros, not whatever the slot holds */
            if (t + 1 < n) b0 = _mm512_loadu_si512(va + stride), b1 = _mm512_loadu_si512(va + stride + 32);
            const __m512bh w[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0), (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                                   (__m512bh)_mm512_unpacklo_epi16(a1, b1), (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
            for (int g = 0; g < rows; g++) {
                const __m512bh pair = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(p + g * Lp + t0 + t));
                for (int j = 0; j < 4; j++) a[g][j] = _mm512_dpbf16_ps(a[g][j], w[j], pair);
            }
        }
    }
    for (int g = 0; g < rows; g++) {
        float lanes[64];
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(lanes + 16 * j, a[g][j]);
        for (int j = 0; j < 4; j++) /* lane i of a[g][j] holds d = 32 (j / 2) + 8 (i / 4) + 4 (j % 2) + i % 4 */
            for (int i = 0; i < 16; i++)
                out[g * 64 + 32 * (j / 2) + 8 * (i / 4) + 4 * (j % 2) + i % 4] = lanes[16 * j + i];
    }
}

static void values_bf16_d64(const uint16_t *v_cache, const int64_t *table, int64_t L, int h0, int nh, int G,
                            int Hkv, int block_size, const float *scores, uint16_t *probs, float *acc) {
    const int64_t Lp = L + (L & 1);
    for (int r = 0; r < nh * G; r++) { /* each row's probabilities in bf16, padded to a whole pair */
        for (int64_t t = 0; t < L; t++) probs[r * Lp + t] = f32_to_bf16(scores[(size_t)r * L + t]);
        if (L & 1) probs[r * Lp + L] = 0;
    }
    for (int hh = 0; hh < nh; hh++) {
        const uint16_t *v_head = v_cache + (int64_t)(h0 + hh) * 64;
        for (int g = hh * G; g < (hh + 1) * G; g += 4) {
            const uint16_t *p = probs + g * Lp;
            switch ((hh + 1) * G - g) {
            case 1: values_d64_rows(v_head, table, L, Hkv, block_size, p, Lp, 1, acc + g * 64); break;
            case 2: values_d64_rows(v_head, table, L, Hkv, block_size, p, Lp, 2, acc + g * 64); break;
            case 3: values_d64_rows(v_head, table, L, Hkv, block_size, p, Lp, 3, acc + g * 64); break;
            default: values_d64_rows(v_head, table, L, Hkv, block_size, p, Lp, 4, acc + g * 64); break;
            }
        }
    }
}
#endif

/* n values starting at element `offset` of a float32 or bfloat16 array, as float32. */
static inline void load_span(const void *base, int64_t offset, int n, int dtype, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + offset, sizeof(float) * n);
    } else {
        const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    }
}

/* The dtype of q and out for a dtype code (above): 0 float32, 1 bfloat16. */
static inline int io_dtype(int dtype) { return dtype == 3 ? 0 : dtype == 2 ? 1 : dtype; }

/* One task: one sequence (q and out point at its rows), kv heads [h0, h1). K and V rows of those
 * heads are read once, in order. */
static int attend(const void *q, const void *k_cache, const void *v_cache, void *out, const float *prefix_out,
                  const float *prefix_lse, const int64_t *table, int64_t start, int64_t end, int h0, int h1, int H,
                  int Hkv, int D, int block_size, float scale, int dtype) {
    const int64_t skip = start % block_size; /* a window's first token may lie inside its block: the */
    start -= skip;                           /* block is walked whole, its earlier tokens scored out */
    const int64_t L = end - start;
    table += start / block_size;
    const int G = H / Hkv, nh = h1 - h0, R = nh * G; /* query rows handled here */
    const int W = nh * D;                               /* floats of one token's K (or V) row */
    /* scores [R, L], q and acc [R, D], one K/V row, then the probabilities in bf16 [R, L + 1] */
    float *scores = malloc(sizeof(float) * ((size_t)R * L + (size_t)R * D * 2 + W) + sizeof(uint16_t) * R * (L + 1));
    if (!scores) return PC_NO_MEMORY;
    float *qf = scores + (size_t)R * L, *acc = qf + R * D, *row = acc + R * D;
    const int io = io_dtype(dtype);
    for (int r = 0; r < R; r++) load_span(q, (int64_t)(h0 * G + r) * D, D, io, qf + r * D);
#if defined(PC_AVX512_BF16_VNNI) || defined(PC_AVX2_FMA)
    if (dtype >= 2) { /* the rows as int8 (attention_int8.h), in the space acc and row leave unused until pass 2 */
        int32_t *quads = (int32_t *)acc;
        float *row_scale = (float *)(quads + R * D / 4), *offset = row_scale + R;
        for (int r = 0; r < R; r++) {
            const int8_t *qq = (const int8_t *)(quads + r * D / 4);
            row_scale[r] = quantize_head(qf + r * D, 0, D, (int8_t *)qq) * scale;
            int sum = 0;
            for (int d = 0; d < D; d++) sum += qq[d];
            offset[r] = 128.f * (float)sum;
        }
        const struct int8_queries iq = {quads, row_scale, offset};
#ifdef PC_AVX512_BF16_VNNI
        if (dtype == 2) scores_int8(&iq, k_cache, table, L, h0, nh, G, Hkv, D, block_size, scores);
#endif
#ifdef PC_AVX2_FMA
        if (dtype == 3) scores_int8_avx2(&iq, k_cache, table, L, h0, nh, G, Hkv, D, block_size, scores);
#endif
    } else
#endif
#ifdef PC_AVX512_BF16
    if (dtype == 1 && block_size % 16 == 0)
        scores_bf16((const uint16_t *)q + (int64_t)h0 * G * D, k_cache, table, L, h0, nh, G, Hkv, D,
                    block_size, scale, scores);
    else
#endif
#ifdef PC_AVX2_FMA
    if (dtype == 0 && D % 32 == 0 && block_size % 16 == 0)
        scores_f32(qf, k_cache, table, L, h0, nh, G, Hkv, D, block_size, scale, scores);
    else
#endif
    /* Tokens are walked block by block: no division per token (it cost more than the math). */
    for (int64_t t = 0, next = 0, k0 = 0; t < L; t++, k0 += 2) { /* pass 1: scores, reading K */
        if (t == next) { k0 = (table[t / block_size] * Hkv + h0) * D * block_size; next += block_size; }
        for (int hh = 0; hh < nh; hh++) /* the token's K rows, gathered from their dimension pairs */
            for (int p = 0; p < D / 2; p++)
                load_span(k_cache, k0 + ((int64_t)hh * D / 2 + p) * 2 * block_size, 2, dtype, row + hh * D + 2 * p);
        for (int r = 0; r < R; r++) {
            const float *qr = qf + r * D, *kr = row + (r / G) * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < D; d++) s += qr[d] * kr[d];
            scores[(size_t)r * L + t] = s * scale;
        }
    }
    float sums[256], maxes[256];
    for (int r = 0; r < R; r++) { /* softmax of each row */
        float *sr = scores + (size_t)r * L, m = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < skip; t++) sr[t] = -INFINITY; /* before the window: weight 0 */
#pragma omp simd reduction(max : m) /* without it, one dependent scalar max per score: a fifth of the kernel */
        for (int64_t t = 0; t < L; t++) m = sr[t] > m ? sr[t] : m;
        for (int64_t t = 0; t < L; t++) { sr[t] = exp_f32(sr[t] - m); sum += sr[t]; }
        sums[r] = sum;
        maxes[r] = m;
    }
#ifdef PC_AVX512_BF16_VNNI
    if (dtype == 2)
        values_int8(v_cache, table, L, h0, nh, G, Hkv, D, block_size, scores, acc);
    else
#endif
#ifdef PC_AVX2_FMA
    if (dtype == 3)
        values_int8_avx2(v_cache, table, L, h0, nh, G, Hkv, D, block_size, scores, acc);
    else
#endif
#ifdef PC_AVX512_BF16
    if (dtype == 1 && D == 64)
        values_bf16_d64(v_cache, table, L, h0, nh, G, Hkv, block_size, scores, (uint16_t *)(row + W), acc);
    else
#endif
#ifdef PC_AVX2_FMA
    if (dtype == 0 && D % 32 == 0 && block_size % 8 == 0)
        values_f32(v_cache, table, L, h0, nh, G, Hkv, D, block_size, scores, acc);
    else
#endif
    {
        memset(acc, 0, sizeof(float) * R * D);
        for (int64_t t = 0, next = 0, slot = 0; t < L; t++) { /* pass 2: weighted values, reading V */
            if (t == next) { slot = table[t / block_size] * block_size; next += block_size; } else slot++;
            load_span(v_cache, (slot * Hkv + h0) * D, W, dtype, row);
            for (int r = 0; r < R; r++) {
                const float p = scores[(size_t)r * L + t], *vr = row + (r / G) * D;
                float *ar = acc + r * D;
#pragma omp simd
                for (int d = 0; d < D; d++) ar[d] += p * vr[d];
            }
        }
    }
    for (int r = 0; r < R; r++) {
        int64_t o = (int64_t)(h0 * G + r) * D;
        float *ar = acc + r * D, inv = 1.f / sums[r];
        if (prefix_out) {
            merge_prefix(ar, sums[r], maxes[r], prefix_out + (h0 * G + r) * D, prefix_lse[h0 * G + r], D);
            inv = 1.f;
        }
        if (io == 0) for (int d = 0; d < D; d++) ((float *)out)[o + d] = ar[d] * inv;
        else for (int d = 0; d < D; d++) ((uint16_t *)out)[o + d] = f32_to_bf16(ar[d] * inv);
    }
    free(scores);
    return 0;
}

struct job {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int64_t *block_tables, *seq_lens, *starts, *prefix_row;
    const float *prefix_out, *prefix_lse;
    int64_t q_stride;
    int B, H, Hkv, D, block_size, max_blocks, dtype, split;
    float scale;
    const int *groups; /* AMX: task t attends rows [groups[t], groups[t + 1]) together (attention_amx.h) */
    int tasks;
    atomic_int next, failed; /* tasks are taken in turn: sequences differ in length */
};

static int attend_task(const struct job *j, int task) {
    const int per = j->Hkv / j->split, h0 = (task % j->split) * per, group = task / j->split;
    const int first = j->groups ? j->groups[group] : group;
    const int64_t size = io_dtype(j->dtype) == 0 ? 4 : 2, p = j->prefix_row ? j->prefix_row[first] : -1;
    const char *q = (const char *)j->q + first * j->q_stride * size;
    char *out = (char *)j->out + (int64_t)first * j->H * j->D * size;
    const float *prefix_out = p >= 0 ? j->prefix_out + p * j->H * j->D : NULL;
    const float *prefix_lse = p >= 0 ? j->prefix_lse + p * j->H : NULL;
    const int64_t start = j->starts ? j->starts[first] : 0;
#ifdef PC_ATTENTION_AMX
    if (j->groups) {
        const int n = j->groups[group + 1] - first;
        return attend_amx((const uint16_t *)q, j->q_stride, j->k_cache, j->v_cache, (uint16_t *)out, prefix_out,
                          prefix_lse, j->block_tables + (int64_t)(first + n - 1) * j->max_blocks, start,
                          j->seq_lens[first], n, h0, h0 + per, j->H, j->Hkv, j->block_size, j->scale);
    }
#endif
    return attend(q, j->k_cache, j->v_cache, out, prefix_out, prefix_lse,
                  j->block_tables + (int64_t)first * j->max_blocks, start, j->seq_lens[first], h0, h0 + per, j->H,
                  j->Hkv, j->D, j->block_size, j->scale, j->dtype);
}

static void attend_tasks(void *ctx, int part, int parts) {
    (void)part, (void)parts;
    struct job *j = ctx;
    for (int task; (task = atomic_fetch_add(&j->next, 1)) < j->tasks * j->split;)
        if (attend_task(j, task)) atomic_store(&j->failed, PC_NO_MEMORY);
}

#ifdef PC_ATTENTION_AMX
/* Whether row b attends with the row before it on AMX tiles: its next position (a prompt chunk's rows, a
 * decode's drafts), the same blocks, the whole sequence from token 0 with nothing merged, and fewer than
 * `most` rows in the group so far. */
static int joins(const struct job *j, int b, int first, int most) {
    const int64_t blocks = (j->seq_lens[b] + j->block_size - 1) / j->block_size;
    return b - first < most && j->seq_lens[b] == j->seq_lens[b - 1] + 1 &&
           (!j->starts || (j->starts[b] == 0 && j->starts[first] == 0)) &&
           (!j->prefix_row || (j->prefix_row[b] < 0 && j->prefix_row[first] < 0)) &&
           !memcmp(j->block_tables + (int64_t)b * j->max_blocks, j->block_tables + (int64_t)(b - 1) * j->max_blocks,
                   sizeof(int64_t) * blocks);
}
#endif

int paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, void *out,
                           const int64_t *block_tables, const int64_t *seq_lens, const int64_t *starts,
                           const int64_t *prefix_row, const float *prefix_out, const float *prefix_lse, int B,
                           int H, int Hkv, int D, int block_size, int max_blocks, float scale, int dtype,
                           int threads) {
#ifndef PC_AVX512_BF16_VNNI
    if (dtype == 2) return PC_UNSUPPORTED;
#endif
#ifndef PC_AVX2_FMA
    if (dtype == 3) return PC_UNSUPPORTED;
#endif
    if (dtype >= 2 && (D % 16 || block_size % 16)) return PC_BAD_SHAPE;
    struct job j = {q, k_cache, v_cache, out, block_tables, seq_lens, starts, prefix_row, prefix_out, prefix_lse,
                    q_stride, B, H, Hkv, D, block_size, max_blocks, dtype, 1, scale, NULL, B, 0, 0};
    int *groups = NULL;
#ifdef PC_ATTENTION_AMX
    static int amx_lent = -1; /* asked once; the answer is the same for every thread */
    if (amx_lent < 0) amx_lent = amx_bf16_tiles();
    if (amx_lent && dtype == 1 && D == 64 && block_size % 16 == 0 && H / Hkv <= 16) {
        if (!(groups = malloc(sizeof(int) * (B + 1)))) return PC_NO_MEMORY;
        /* as many rows as a tile holds, but not so many that the threads run out of tasks (a row's
         * result is the same either way: one decode's few drafts stay apart, measured 0.86-0.93x together) */
        const int fill = 16 / (H / Hkv), share = (B + 2 * threads - 1) / (2 * threads);
        const int most = fill < share ? fill : share;
        j.tasks = 0;
        for (int b = 0; b < B; b++)
            if (b == 0 || !joins(&j, b, groups[j.tasks - 1], most)) groups[j.tasks++] = b;
        groups[j.tasks] = B;
        j.groups = groups;
    }
#endif
    /* Enough tasks: one each, all heads (contiguous reads). Few: split by kv head too. */
    j.split = j.tasks >= 2 * threads ? 1 : Hkv;
    pool_run(threads, attend_tasks, &j);
    free(groups);
    return atomic_load(&j.failed);
}
