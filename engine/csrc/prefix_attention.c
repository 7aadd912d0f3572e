/* The shared prefix of a cascade (engine/attention.py), once for all the query rows that share it:
 * every sharing row's queries against the prefix's P tokens as two tiled matrix products of bf16
 * pair dot products (vdpbf16ps, fp32 accumulation) with no horizontal sums. Scores come 16 tokens
 * to a vector from K laid out as pairs of dimensions; outputs 16 dimensions to a vector from V laid
 * out as pairs of tokens, against each row's two probabilities rounded to bf16 (as flash attention
 * rounds P, and as paged_attention.c does). paged_attention.c then attends each row's own tokens
 * and merges the two softmaxes exactly.
 *
 * Layouts (built once per prefix by engine/attention.py's prefix_operands), P % 16 == 0, D 64 or 128:
 *   q    [S, H, D] bf16, rows q_stride elements apart (heads contiguous)
 *   kt   [Hkv, D/2, P, 2] bf16: kt[h, i, t] = (k[t, h, 2i], k[t, h, 2i + 1])
 *   vp   [Hkv, P/2, D, 2] bf16: vp[h, j, d] = (v[2j, h, d], v[2j + 1, h, d])
 *   out  [S, H, D] fp32, normalised; lse [S, H] fp32, the log of each row's softmax denominator.
 * Return 0, -1 where this CPU lacks AVX-512 BF16 or the shape is not served, -2 out of memory.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"
#include "exp.h"
#include "pool.h"

#ifdef PC_AVX512_BF16
#include <immintrin.h>

#define SCORE_ROWS 8 /* query vectors of a score tile: 8 x 2 token vectors = 16 accumulators */
#define CHUNK 48     /* query vectors of a task: a multiple of every tile's row count */

/* Scores of SCORE_ROWS query vectors against tokens [t0, t0 + 16 NT): one K vector per dimension
 * pair and token vector serves every row. */
ALWAYS_INLINE void score_tile(const int32_t *const *q, const uint16_t *kt, int64_t P, int D, int64_t t0,
                              float scale, float *const *scores, const int NT) {
    __m512 acc[SCORE_ROWS][2];
    for (int r = 0; r < SCORE_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int i = 0; i < D / 2; i++) {
        const uint16_t *k = kt + ((int64_t)i * P + t0) * 2;
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k);
        const __m512bh k1 = NT == 2 ? (__m512bh)_mm512_loadu_si512(k + 32) : k0;
        for (int r = 0; r < SCORE_ROWS; r++) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32(q[r][i]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, pair);
            if (NT == 2) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, pair);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int r = 0; r < SCORE_ROWS; r++)
        for (int n = 0; n < NT; n++) _mm512_storeu_ps(scores[r] + t0 + 16 * n, _mm512_mul_ps(acc[r][n], s));
}

/* out rows = (probabilities . V) * inv for RV query vectors: ND vectors of V (D = 16 ND) per token
 * pair serve every row. The arrays have fixed sizes (RV * ND <= 24, ND <= 8): sized by the
 * arguments they would be variable-length, and gcc keeps those in memory (measured: 3.5x slower). */
ALWAYS_INLINE void value_tile(const int32_t *const *p, const uint16_t *vp, int64_t P, float *const *out,
                              const float *inv, const int ND, const int RV) {
    __m512 acc[6][8];
    for (int r = 0; r < RV; r++)
        for (int n = 0; n < ND; n++) acc[r][n] = _mm512_setzero_ps();
    for (int64_t j = 0; j < P / 2; j++) {
        const uint16_t *v = vp + j * ND * 32;
        __m512bh w[8];
        for (int n = 0; n < ND; n++) w[n] = (__m512bh)_mm512_loadu_si512(v + 32 * n);
        for (int r = 0; r < RV; r++) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32(p[r][j]);
            for (int n = 0; n < ND; n++) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], w[n], pair);
        }
    }
    for (int r = 0; r < RV; r++)
        for (int n = 0; n < ND; n++)
            _mm512_storeu_ps(out[r] + 16 * n, _mm512_mul_ps(acc[r][n], _mm512_set1_ps(inv[r])));
}

struct job {
    const uint16_t *q, *kt, *vp;
    float *out, *lse;
    int64_t q_stride, P;
    int S, H, Hkv, D, chunks;
    float scale;
    atomic_int next, failed;
};

/* Query vector v of kv head h is row v / G, head h G + v % G. */
static int64_t head_row(const struct job *j, int h, int v) {
    const int G = j->H / j->Hkv;
    return (int64_t)(v / G) * j->H + h * G + v % G;
}

/* One task: kv head h, query vectors [v0, v0 + n). Tiles past n repeat the last vector (same
 * values written twice), so every tile is whole. */
static void attend_chunk(const struct job *j, int h, int v0, int n, float *scores, uint16_t *probs) {
    const int64_t P = j->P;
    const int D = j->D, G = j->H / j->Hkv;
    const uint16_t *kt = j->kt + (int64_t)h * D * P, *vp = j->vp + (int64_t)h * D * P;
    float inv[CHUNK];
    for (int r0 = 0; r0 < n; r0 += SCORE_ROWS) {
        const int32_t *q[SCORE_ROWS];
        float *rows[SCORE_ROWS];
        for (int r = 0; r < SCORE_ROWS; r++) {
            const int v = r0 + r < n ? r0 + r : n - 1;
            q[r] = (const int32_t *)(j->q + (int64_t)((v0 + v) / G) * j->q_stride + (h * G + (v0 + v) % G) * D);
            rows[r] = scores + (int64_t)v * P;
        }
        int64_t t0 = 0;
        for (; t0 + 32 <= P; t0 += 32) score_tile(q, kt, P, D, t0, j->scale, rows, 2);
        if (t0 < P) score_tile(q, kt, P, D, t0, j->scale, rows, 1);
    }
    for (int v = 0; v < n; v++) { /* softmax: probabilities in bf16, the denominator in fp32 */
        float *s = scores + (int64_t)v * P, m = -INFINITY, sum = 0.f;
        uint16_t *p = probs + (int64_t)v * P;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < P; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < P; t++) {
            s[t] = exp_f32(s[t] - m);
            sum += s[t];
        }
        for (int64_t t = 0; t < P; t += 16)
            _mm256_storeu_si256((__m256i *)(p + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t)));
        inv[v] = 1.f / sum;
        j->lse[head_row(j, h, v0 + v)] = m + logf(sum);
    }
    const int ND = D / 16, RV = ND == 4 ? 6 : 3;
    for (int r0 = 0; r0 < n; r0 += RV) {
        const int32_t *p[6];
        float *out[6], scale[6];
        for (int r = 0; r < RV; r++) {
            const int v = r0 + r < n ? r0 + r : n - 1;
            p[r] = (const int32_t *)(probs + (int64_t)v * P);
            out[r] = j->out + head_row(j, h, v0 + v) * D;
            scale[r] = inv[v];
        }
        if (ND == 4) value_tile(p, vp, P, out, scale, 4, 6);
        else value_tile(p, vp, P, out, scale, 8, 3);
    }
}

static void tasks(void *ctx, int part, int parts) {
    (void)part, (void)parts;
    struct job *j = ctx;
    float *scores = malloc(sizeof(float) * CHUNK * j->P + sizeof(uint16_t) * CHUNK * j->P);
    if (!scores) {
        atomic_store(&j->failed, 1);
        return;
    }
    uint16_t *probs = (uint16_t *)(scores + CHUNK * j->P);
    const int SG = j->S * (j->H / j->Hkv);
    for (int task; (task = atomic_fetch_add(&j->next, 1)) < j->Hkv * j->chunks;) {
        const int h = task / j->chunks, v0 = (task % j->chunks) * CHUNK;
        attend_chunk(j, h, v0, SG - v0 < CHUNK ? SG - v0 : CHUNK, scores, probs);
    }
    free(scores);
}

int prefix_attention(const void *q, int64_t q_stride, const void *kt, const void *vp, float *out, float *lse,
                     int S, int H, int Hkv, int D, int64_t P, float scale, int threads) {
    if ((D != 64 && D != 128) || P % 16 || P <= 0 || H % Hkv) return PC_BAD_SHAPE;
    if (S <= 0) return 0;
    const int chunks = (S * (H / Hkv) + CHUNK - 1) / CHUNK;
    struct job j = {q, kt, vp, out, lse, q_stride, P, S, H, Hkv, D, chunks, scale, 0, 0};
    if (threads > Hkv * chunks) threads = Hkv * chunks;
    pool_run(threads, tasks, &j);
    return atomic_load(&j.failed) ? PC_NO_MEMORY : PC_OK;
}

#else
int prefix_attention(const void *q, int64_t q_stride, const void *kt, const void *vp, float *out, float *lse,
                     int S, int H, int Hkv, int D, int64_t P, float scale, int threads) {
    (void)q, (void)q_stride, (void)kt, (void)vp, (void)out, (void)lse, (void)S, (void)H, (void)Hkv, (void)D;
    (void)P, (void)scale, (void)threads;
    return PC_UNSUPPORTED;
}
#endif
