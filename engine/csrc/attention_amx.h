/* Decode attention's two passes on AMX bf16 tiles (included by paged_attention.c): bf16 caches, D == 64,
 * block_size % 16 == 0, where the CPU has AMX-BF16 and Linux lends it. The G query rows of one kv head
 * are one tile's rows (a tile of G rows does G rows' work).
 *
 * Scores: K lies in dimension pairs ([D/2, block_size, 2] a head), which is already what TDPBF16PS takes
 * as its second operand, 16 tokens a tile: two products (32 dimensions each) give 16 tokens' scores for
 * every row. Values: 32 tokens at a time, each pair of tokens' V rows interleaved into bf16 pairs (as
 * values_d64_rows does) and written out as four tiles of 16 dimensions; the rows' probabilities, in bf16,
 * are the first operand. Sums in fp32, in an order of the hardware's: results differ from the AVX-512
 * passes by rounding, and every row on such a CPU takes these, so a row computes the same in any batch.
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

/* Tile 0: G rows x 16 fp32 scores; 1, 2: G query rows, 32 bf16 each (or 32 tokens' probabilities);
 * 3: 16 pairs x 16 columns x 2 (K's dimension pairs, or V's token pairs); 4-7: G rows x 16 fp32 outputs. */
static void attention_amx_configure(int G) {
    struct attention_tiles c = {.palette = 1};
    for (int t = 0; t < 8; t++) c.bytes_per_row[t] = 64, c.rows[t] = t == 3 ? 16 : G;
    _tile_loadconfig(&c);
}

/* Pass 1: scores [R, L] of the R = nh * G rows q (64 apart) against kv heads [h0, h0 + nh), scaled. */
static void scores_amx(const uint16_t *q, const uint16_t *k_cache, const int64_t *table, int64_t L, int h0, int nh,
                       int G, int Hkv, int block_size, float scale, float *scores) {
    const int64_t head = 64 * block_size, pair_stride = 2 * block_size;
    float tile[256] __attribute__((aligned(64)));
    const __m512 s = _mm512_set1_ps(scale);
    for (int hh = 0; hh < nh; hh++) {
        _tile_loadd(1, q + hh * G * 64, 128);
        _tile_loadd(2, q + hh * G * 64 + 32, 128);
        for (int64_t t0 = 0; t0 < L; t0 += 16) {
            const uint16_t *k = k_cache + (table[t0 / block_size] * Hkv + h0 + hh) * head + t0 % block_size * 2;
            if ((t0 + 16) % block_size == 0 && t0 + 16 < L) /* the next block lies anywhere: fetch it now */
                prefetch_span(k_cache + (table[(t0 + 16) / block_size] * Hkv + h0 + hh) * head, head * 2);
            _tile_zero(0);
            _tile_loadd(3, k, pair_stride * 2);
            _tile_dpbf16ps(0, 1, 3);
            _tile_loadd(3, k + 16 * pair_stride, pair_stride * 2);
            _tile_dpbf16ps(0, 2, 3);
            _tile_stored(0, tile, 64);
            const __mmask16 valid = L - t0 < 16 ? (__mmask16)((1u << (L - t0)) - 1) : (__mmask16)0xFFFF;
            for (int r = 0; r < G; r++)
                _mm512_mask_storeu_ps(scores + (size_t)(hh * G + r) * L + t0, valid,
                                      _mm512_mul_ps(_mm512_load_ps(tile + 16 * r), s));
        }
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

/* Pass 2: acc [R, 64] = probabilities (scores [R, L] after the softmax, rounded to bf16 into probs, rows
 * Lp apart, Lp a multiple of 32) times V. */
static void values_amx(const uint16_t *v_cache, const int64_t *table, int64_t L, int h0, int nh, int G, int Hkv,
                       int block_size, const float *scores, uint16_t *probs, int64_t Lp, float *acc) {
    uint16_t vb[4][16 * 32] __attribute__((aligned(64)));
    float tile[256] __attribute__((aligned(64)));
    const int64_t stride = (int64_t)Hkv * 64;
    for (int r = 0; r < nh * G; r++) {
        for (int64_t t = 0; t < L; t++) probs[r * Lp + t] = f32_to_bf16(scores[(size_t)r * L + t]);
        for (int64_t t = L; t < Lp; t++) probs[r * Lp + t] = 0;
    }
    for (int hh = 0; hh < nh; hh++) {
        const uint16_t *v_head = v_cache + (int64_t)(h0 + hh) * 64;
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t t0 = 0; t0 < L; t0 += 32) {
            v_tiles(v_head, table, t0, L, stride, block_size, vb);
            _tile_loadd(1, probs + hh * G * Lp + t0, Lp * 2);
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
            for (int r = 0; r < G; r++) /* lane i of tile j holds d = 32 (j / 2) + 8 (i / 4) + 4 (j % 2) + i % 4 */
                for (int i = 0; i < 16; i++)
                    acc[(hh * G + r) * 64 + 32 * (j / 2) + 8 * (i / 4) + 4 * (j % 2) + i % 4] = tile[16 * r + i];
        }
    }
}
#endif

#endif
