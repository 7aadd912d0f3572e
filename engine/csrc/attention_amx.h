/* Paged attention on AMX bf16 tiles (included by paged_attention.c): bf16 caches, D == 64,
 * block_size % 16 == 0, where the CPU has AMX-BF16 and Linux lends it. Every row the kernel attends
 * takes this path on such a CPU.
 *
 * A task attends n consecutive rows of one sequence (n > 1: positions of a prompt chunk, each over its
 * own prefix; a decode is n == 1), and the n * G query rows of one kv head are one tile's rows. Scores:
 * K lies in dimension pairs ([D/2, block_size, 2] a head), which is already what TDPBF16PS takes as its
 * second operand, 16 tokens a tile: two products (32 dimensions each) give 16 tokens' scores for every
 * row. Values: 32 tokens at a time, each pair of tokens' V rows interleaved into bf16 pairs (as
 * values_d64_rows does in registers) and written out as four tiles of 16 dimensions; the rows'
 * probabilities, in bf16, are the first operand. Sums in fp32, in an order of the hardware's.
 *
 * A row computes the same bits alone or among others, in any chunking: a tile's rows are independent;
 * its softmax runs over its own tokens in a fixed vector order (softmax_row); past its own end its
 * probabilities are zeros, whose products add nothing. Results differ from the AVX-512 passes by rounding.
 * Measured (2026-12-06, a Xeon with AMX, SmolLM2's heads, a batch-64 decode step's 30 layers of ~350
 * tokens each): 19-20 ms on the AVX-512 passes, 15-16 ms on these; fetching the next tokens' V rows
 * ahead (as the AVX-512 pass does) made these slower, 18-19 ms, so they do not. */
#ifndef PAGEDCHAT_ATTENTION_AMX_H
#define PAGEDCHAT_ATTENTION_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(PC_AVX512_BF16)
#define PC_ATTENTION_AMX 1

struct attention_tiles {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* Tile 0: `rows` x 16 fp32 scores; 1, 2: the query rows, 32 bf16 each (or 32 tokens' probabilities);
 * 3: 16 pairs x 16 columns x 2 (K's dimension pairs, or V's token pairs); 4-7: `rows` x 16 fp32 outputs. */
static void attention_amx_configure(int rows) {
    struct attention_tiles c = {.palette = 1};
    for (int t = 0; t < 8; t++) c.bytes_per_row[t] = 64, c.rows[t] = t == 3 ? 16 : rows;
    _tile_loadconfig(&c);
}

/* s[0..n) -> exp(s - max) in place, 16 lanes at a time from s[0] (the same order wherever the row
 * lies, so the same bits); returns the sum, *max the maximum. */
static float softmax_row(float *s, int64_t n, float *max) {
    __m512 m = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 valid = n - t < 16 ? (__mmask16)((1u << (n - t)) - 1) : (__mmask16)0xFFFF;
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, s + t));
    }
    *max = _mm512_reduce_max_ps(m);
    const __m512 top = _mm512_set1_ps(*max);
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 valid = n - t < 16 ? (__mmask16)((1u << (n - t)) - 1) : (__mmask16)0xFFFF;
        const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, s + t), top)));
        _mm512_mask_storeu_ps(s + t, valid, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* Scores [rows, L] (rows L apart) of the tile's query rows q ([rows, 64] bf16) against one kv head's K. */
static void scores_amx(const uint16_t *q, const uint16_t *k_cache, const int64_t *table, int64_t L, int kv_head,
                       int rows, int Hkv, int block_size, float scale, float *scores) {
    const int64_t head = 64 * block_size, pair_stride = 2 * block_size;
    float tile[256] __attribute__((aligned(64)));
    const __m512 s = _mm512_set1_ps(scale);
    _tile_loadd(1, q, 128);
    _tile_loadd(2, q + 32, 128);
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const uint16_t *k = k_cache + (table[t0 / block_size] * Hkv + kv_head) * head + t0 % block_size * 2;
        if ((t0 + 16) % block_size == 0 && t0 + 16 < L) /* the next block lies anywhere: fetch it now */
            prefetch_span(k_cache + (table[(t0 + 16) / block_size] * Hkv + kv_head) * head, head * 2);
        _tile_zero(0);
        _tile_loadd(3, k, pair_stride * 2);
        _tile_dpbf16ps(0, 1, 3);
        _tile_loadd(3, k + 16 * pair_stride, pair_stride * 2);
        _tile_dpbf16ps(0, 2, 3);
        _tile_stored(0, tile, 64);
        const __mmask16 valid = L - t0 < 16 ? (__mmask16)((1u << (L - t0)) - 1) : (__mmask16)0xFFFF;
        for (int r = 0; r < rows; r++)
            _mm512_mask_storeu_ps(scores + (size_t)r * L + t0, valid, _mm512_mul_ps(_mm512_load_ps(tile + 16 * r), s));
    }
}

/* 32 tokens of one head's V from t0, as tile 3's four operands: vb[j] holds 16 token pairs x 16
 * dimensions (values_d64_rows' lane order); tokens past L are zeros. */
static void v_tiles(const uint16_t *v_head, const int64_t *table, int64_t t0, int64_t L, int64_t stride,
                    int block_size, uint16_t vb[4][16 * 32]) {
    for (int j = 0; j < 16; j++) {
        const int64_t t = t0 + 2 * j;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
        if (t < L) {
            const uint16_t *va = v_head + (table[t / block_size] * block_size + t % block_size) * stride;
            a0 = _mm512_loadu_si512(va), a1 = _mm512_loadu_si512(va + 32);
            if (t + 1 < L) b0 = _mm512_loadu_si512(va + stride), b1 = _mm512_loadu_si512(va + stride + 32);
        }
        _mm512_store_si512(vb[0] + 32 * j, _mm512_unpacklo_epi16(a0, b0));
        _mm512_store_si512(vb[1] + 32 * j, _mm512_unpackhi_epi16(a0, b0));
        _mm512_store_si512(vb[2] + 32 * j, _mm512_unpacklo_epi16(a1, b1));
        _mm512_store_si512(vb[3] + 32 * j, _mm512_unpackhi_epi16(a1, b1));
    }
}

/* acc [rows, 64] = probs ([rows, Lp] bf16, zeros past each row's end, Lp a multiple of 32) times one
 * kv head's V over L tokens. */
static void values_amx(const uint16_t *v_cache, const int64_t *table, int64_t L, int kv_head, int rows, int Hkv,
                       int block_size, const uint16_t *probs, int64_t Lp, float *acc) {
    uint16_t vb[4][16 * 32] __attribute__((aligned(64)));
    float tile[256] __attribute__((aligned(64)));
    const int64_t stride = (int64_t)Hkv * 64;
    const uint16_t *v_head = v_cache + (int64_t)kv_head * 64;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t t0 = 0; t0 < L; t0 += 32) {
        v_tiles(v_head, table, t0, L, stride, block_size, vb);
        _tile_loadd(1, probs + t0, Lp * 2);
        _tile_loadd(3, vb[0], 64);
        _tile_dpbf16ps(4, 1, 3);
        _tile_loadd(3, vb[1], 64);
        _tile_dpbf16ps(5, 1, 3);
        _tile_loadd(3, vb[2], 64);
        _tile_dpbf16ps(6, 1, 3);
        _tile_loadd(3, vb[3], 64);
        _tile_dpbf16ps(7, 1, 3);
    }
    for (int j = 0; j < 4; j++) {
        switch (j) { /* tile numbers are constants */
        case 0: _tile_stored(4, tile, 64); break;
        case 1: _tile_stored(5, tile, 64); break;
        case 2: _tile_stored(6, tile, 64); break;
        default: _tile_stored(7, tile, 64); break;
        }
        for (int r = 0; r < rows; r++) /* lane i of tile j holds d = 32 (j / 2) + 8 (i / 4) + 4 (j % 2) + i % 4 */
            for (int i = 0; i < 16; i++)
                acc[r * 64 + 32 * (j / 2) + 8 * (i / 4) + 4 * (j % 2) + i % 4] = tile[16 * r + i];
    }
}

/* Rows [0, n) of one sequence, row i at q + i * q_stride attending to tokens [start, len0 + i) (n > 1
 * only where start == 0 and no prefix is merged), kv heads [h0, h1), out rows H * 64 apart; table the
 * last row's (it holds the others'). prefix_out / prefix_lse: as attend()'s, for n == 1. */
static int attend_amx(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                      uint16_t *out, const float *prefix_out, const float *prefix_lse, const int64_t *table,
                      int64_t start, int64_t len0, int n, int h0, int h1, int H, int Hkv, int block_size,
                      float scale) {
    const int64_t skip = start % block_size; /* a window's first token may lie inside its block */
    start -= skip;
    const int64_t L = len0 + n - 1 - start, Lp = (L + 31) / 32 * 32;
    table += start / block_size;
    const int G = H / Hkv, rows = n * G; /* a kv head's query rows: (position, head) */
    /* scores [rows, L], acc [rows, 64], probabilities [rows, Lp] and the query rows [rows, 64] in bf16 */
    float *scores = malloc(sizeof(float) * (size_t)rows * (L + 64) + sizeof(uint16_t) * rows * (Lp + 64));
    if (!scores) return PC_NO_MEMORY;
    float *acc = scores + (size_t)rows * L;
    uint16_t *probs = (uint16_t *)(acc + rows * 64), *qt = probs + (size_t)rows * Lp;
    attention_amx_configure(rows);
    for (int h = h0; h < h1; h++) {
        for (int i = 0; i < n; i++)
            memcpy(qt + i * G * 64, q + i * q_stride + (int64_t)h * G * 64, sizeof(uint16_t) * G * 64);
        scores_amx(qt, k_cache, table, L, h, rows, Hkv, block_size, scale, scores);
        float sums[16], maxes[16];
        for (int r = 0; r < rows; r++) {
            float *sr = scores + (size_t)r * L;
            const int64_t own = L - (n - 1 - r / G); /* this row's tokens */
            for (int64_t t = 0; t < skip; t++) sr[t] = -INFINITY; /* before the window: weight 0 */
            sums[r] = softmax_row(sr, own, &maxes[r]);
            for (int64_t t = 0; t < Lp; t++) probs[r * Lp + t] = t < own ? f32_to_bf16(sr[t]) : 0;
        }
        values_amx(v_cache, table, L, h, rows, Hkv, block_size, probs, Lp, acc);
        for (int r = 0; r < rows; r++) {
            const int g = h * G + r % G;
            float *ar = acc + r * 64, inv = 1.f / sums[r];
            if (prefix_out) {
                merge_prefix(ar, sums[r], maxes[r], prefix_out + g * 64, prefix_lse[g], 64);
                inv = 1.f;
            }
            uint16_t *o = out + (int64_t)(r / G) * H * 64 + g * 64;
            for (int d = 0; d < 64; d++) o[d] = f32_to_bf16(ar[d] * inv);
        }
    }
    _tile_release();
    free(scores);
    return 0;
}
#endif

#endif
