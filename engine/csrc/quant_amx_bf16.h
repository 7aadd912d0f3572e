/* 4-bit weights on AMX bf16 tiles (included by quant_matmul.c after quant_amx.h): each block of 16 columns
 * is widened once to bf16 weights, w = (q - 8) * scale + zero rounded to bf16, laid out as TDPBF16PS takes
 * them (pairs of inputs per column), and every tile of 16 rows meets them with fp32 sums over all K. A row
 * computes the same in any batch (its tile rows are its own; the sums run in the same order). */
#ifndef PAGEDCHAT_QUANT_AMX_BF16_H
#define PAGEDCHAT_QUANT_AMX_BF16_H

#if defined(PC_AMX) && defined(__AMX_BF16__)
#define PC_AMX_BF16 1

/* Tiles 0-3: 16 rows x 16 fp32 sums; 4: 16 rows x 32 bf16 inputs; 5: 16 pairs x 16 columns x 2 weights. */
static void amx_bf16_configure(void) {
    struct tile_config c = {.palette = 1};
    for (int t = 0; t < 6; t++) c.bytes_per_row[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

/* Block b's weights as bf16 pairs: out [K/2][32] (row 2j: k = 4j, 4j+1 of each column; row 2j + 1: 4j+2, 4j+3). */
static void amx_bf16_widen(const uint8_t *packed, const uint16_t *scales, uint16_t *out, int64_t b, int K, int G,
                           int group) {
    const __m512i nibbles = _mm512_set1_epi16(0x0F0F), low_bytes = _mm512_set1_epi16(0x00FF);
    const __m512i pair_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i pair_hi = _mm512_add_epi32(pair_lo, _mm512_set1_epi32(8));
    const __m512 minus_eight = _mm512_set1_ps(-8.f);
    const uint8_t *block = packed + b * (K / 4) * 32;
    __m512 s_lo = _mm512_setzero_ps(), s_hi = s_lo, z_lo = s_lo, z_hi = s_lo;
    for (int j = 0; j < K / 4; j++) {
        if (4 * j % group == 0) {
            const uint16_t *sz = scales + ((b * G + 4 * j / group) * 2) * 16;
            const __m512 s = load16_bf16(sz), shift = _mm512_fmadd_ps(minus_eight, s, load16_bf16(sz + 16));
            s_lo = _mm512_permutexvar_ps(pair_lo, s), s_hi = _mm512_permutexvar_ps(pair_hi, s);
            z_lo = _mm512_permutexvar_ps(pair_lo, shift), z_hi = _mm512_permutexvar_ps(pair_hi, shift);
        }
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block + j * 32)));
        const __m512i q = _mm512_ternarylogic_epi32(words, _mm512_slli_epi16(words, 4), nibbles, 0xA8);
        const __m512i halves[2] = {_mm512_and_si512(q, low_bytes), _mm512_srli_epi16(q, 8)};
        for (int h = 0; h < 2; h++) {
            const __m512 lo = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(halves[h]))), s_lo, z_lo);
            const __m512 hi = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(halves[h], 1))), s_hi, z_hi);
            _mm512_storeu_si512(out + (2 * j + h) * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

struct bf16_job {
    const uint8_t *packed;
    const uint16_t *scales, *x, *tail; /* tail: rows past the last whole tile, then zeros (16 rows), or NULL */
    uint16_t *y;
    int M, K, G, group, N;
};

#define BF16_TILE_STEP(T)                                                                                          \
    do {                                                                                                           \
        const int r0 = m0 + 16 * (T);                                                                              \
        _tile_loadd(4, (r0 + 16 <= j->M ? j->x + (int64_t)r0 * K : j->tail) + 32 * kk, 2 * K);                    \
        _tile_dpbf16ps(T, 4, 5);                                                                                   \
    } while (0)
#define BF16_TILE_OUT(T)                                                                                           \
    do {                                                                                                           \
        _tile_stored(T, sums, 64);                                                                                 \
        for (int m = 0; m < 16 && m0 + 16 * (T) + m < j->M; m++)                                                   \
            _mm256_storeu_si256((__m256i *)(j->y + (int64_t)(m0 + 16 * (T) + m) * j->N + b * 16),                \
                                (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums + 16 * m)));                       \
    } while (0)

static void bf16_part(void *ctx, int part, int parts) {
    const struct bf16_job *j = ctx;
    const int K = j->K, M16 = (j->M + 15) / 16 * 16;
    uint16_t *w = aligned_alloc(64, (size_t)K * 32);
    float sums[256] __attribute__((aligned(64)));
    if (!w) return;
    amx_bf16_configure();
    for (int64_t b = pool_share(j->N / 16, part, parts); b < pool_share(j->N / 16, part + 1, parts); b++) {
        amx_bf16_widen(j->packed, j->scales, w, b, K, j->G, j->group);
        for (int m0 = 0; m0 < M16; m0 += 64) {
            const int tiles = (M16 - m0) / 16 < 4 ? (M16 - m0) / 16 : 4;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int kk = 0; kk < K / 32; kk++) {
                _tile_loadd(5, w + kk * 16 * 32, 64);
                BF16_TILE_STEP(0);
                if (tiles > 1) BF16_TILE_STEP(1);
                if (tiles > 2) BF16_TILE_STEP(2);
                if (tiles > 3) BF16_TILE_STEP(3);
            }
            BF16_TILE_OUT(0);
            if (tiles > 1) BF16_TILE_OUT(1);
            if (tiles > 2) BF16_TILE_OUT(2);
            if (tiles > 3) BF16_TILE_OUT(3);
        }
    }
    _tile_release();
    free(w);
}
#undef BF16_TILE_STEP
#undef BF16_TILE_OUT
#endif

#endif
