/* AMX tiles for the int8-row kernels (included by quant_matmul.c after quant_int8_rows.h): where the CPU
 * has AMX-INT8 and the kernel asks for them, whole tiles of 16 rows take these instead of the VNNI tiles.
 *
 * One TDPBSUD multiplies 16 rows of 32 int8 inputs (signed) by 16 columns of the same inputs' weights
 * (unsigned, in the VNNI tiles' own quad order, so the 8-bit layouts load as they are and a 4-bit block is
 * widened once for all its row tiles). The integer sums per 32 inputs are exact, and the float steps after
 * them are tile4_i8's, tile8_i8's and tile8g_i8's in the same order: a row computes bit-identically through
 * either kind of tile, so the choice between them (made per row count by measurement, engine/quant/choose.py)
 * only changes the speed. */
#ifndef PAGEDCHAT_QUANT_AMX_H
#define PAGEDCHAT_QUANT_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PC_AMX 1
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static _Atomic int64_t amx_tile_count; /* (16 rows x 16 columns) tiles computed on AMX: amx_tiles_computed() */

/* Linux lends a process the tiles' state only when asked (else the first tile instruction faults). */
static int amx_permitted(void) {
    static int answer = -1;
    if (answer < 0) answer = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return answer;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* Tile 0 (and 3): 16 rows x 16 int32 sums; 1 (and 4): 16 rows x 32 int8 inputs; 2 (and 5): 8 quads x 16
 * columns x 4 weights. Tile state is per thread: each part loads it. */
static void amx_configure(void) {
    struct tile_config c = {.palette = 1};
    for (int t = 0; t < 6; t += 3) {
        c.bytes_per_row[t] = 64, c.rows[t] = 16;
        c.bytes_per_row[t + 1] = 32, c.rows[t + 1] = 16;
        c.bytes_per_row[t + 2] = 64, c.rows[t + 2] = 8;
    }
    _tile_loadconfig(&c);
}

/* A 4- or 5-bit block of 16 columns widened to bytes, quad after quad (64 bytes each): tile4_i8's q. */
ALWAYS_INLINE void amx_widen(const uint8_t *packed, uint8_t *out, int64_t b, int K, const int BITS) {
    const __m512i nibbles = _mm512_set1_epi16(0x0F0F), sixteen = _mm512_set1_epi8(16);
    const int stride = BITS == 5 ? 40 : 32;
    const uint8_t *block = packed + b * (K / 4) * stride;
    for (int j = 0; j < K / 4; j++) {
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(block + j * 32)));
        __m512i q = _mm512_ternarylogic_epi32(words, _mm512_slli_epi16(words, 4), nibbles, 0xA8);
        if (BITS == 5) q = _mm512_mask_add_epi8(q, _load_mask64((__mmask64 *)(block + (K / 4) * 32 + j * 8)), q, sixteen);
        _mm512_storeu_si512(out + j * 64, q);
    }
}

/* The sums of 32 inputs `a` for rows m0..m0+15 against one block's weights (8 quads of 64 bytes), into dot. */
#define AMX_DOT(C, X, W, xq, weights, m0, a, K, dot)                                   \
    do {                                                                               \
        _tile_zero(C);                                                                 \
        _tile_loadd(X, (xq) + (int64_t)(m0) * (K) + 32 * (a), (K));                    \
        _tile_loadd(W, (weights) + (int64_t)(a) * 8 * 64, 64);                         \
        _tile_dpbsud(C, X, W);                                                         \
        _tile_stored(C, (dot), 64);                                                    \
    } while (0)

/* Rows m0..m0+15 by block b; `weights` the block's bytes [K/4][64] (widened, or the 8-bit layout itself). */
ALWAYS_INLINE void amx_tile(const uint8_t *weights, const void *scales, const int8_t *xq, const float *xd,
                            const float *xsum, const float *xqsum, uint16_t *y, int64_t b, int m0, int K, int G,
                            int group, int N, const enum kind KIND) {
    const int A = K / 32;
    const __m512 minus_offset = _mm512_set1_ps(KIND == INT5_I8 ? -16.f : -8.f);
    int32_t dot[2][256] __attribute__((aligned(64)));
    __m512 total[16];
    for (int m = 0; m < 16; m++) total[m] = _mm512_setzero_ps();
    AMX_DOT(0, 1, 2, xq, weights, m0, 0, K, dot[0]);
    for (int a = 0; a < A; a++) {
        /* the next sums run on the other tiles while these are scaled */
        if (a + 1 < A) {
            if (a % 2) AMX_DOT(0, 1, 2, xq, weights, m0, a + 1, K, dot[0]);
            else AMX_DOT(3, 4, 5, xq, weights, m0, a + 1, K, dot[1]);
        }
        const int32_t *d = dot[a % 2];
        if (KIND == INT8_I8) {
            for (int m = 0; m < 16; m++)
                total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(d + 16 * m)),
                                           _mm512_set1_ps(xd[(int64_t)(m0 + m) * A + a]), total[m]);
            continue;
        }
        const int g = a * 32 / group;
        const uint16_t *sz = (const uint16_t *)scales + ((b * G + g) * 2) * 16;
        const __m512 s = load16_bf16(sz), z = load16_bf16(sz + 16);
        const __m512 shift = _mm512_fmadd_ps(minus_offset, s, z);
        for (int m = 0; m < 16; m++) {
            const int64_t at = (int64_t)(m0 + m) * A + a;
            const __m512 sums = _mm512_cvtepi32_ps(_mm512_load_si512(d + 16 * m));
            if (KIND == INT8G_I8) {
                const __m512 own = _mm512_fmsub_ps(sums, _mm512_set1_ps(xd[at]), _mm512_set1_ps(128.f * xqsum[at]));
                total[m] = _mm512_fmadd_ps(own, s, total[m]);
                total[m] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[at]), z, total[m]);
            } else {
                total[m] = _mm512_fmadd_ps(sums, _mm512_mul_ps(s, _mm512_set1_ps(xd[at])), total[m]);
                total[m] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[at]), shift, total[m]);
            }
        }
    }
    const __m512 s = KIND == INT8_I8 ? _mm512_loadu_ps((const float *)scales + b * 16) : _mm512_setzero_ps();
    for (int m = 0; m < 16; m++) {
        /* INT8_I8: xsum holds tile8_i8's xbias */
        const __m512 out = KIND == INT8_I8 ? _mm512_mul_ps(_mm512_sub_ps(total[m], _mm512_set1_ps(xsum[m0 + m])), s)
                                           : total[m];
        _mm256_storeu_si256((__m256i *)(y + (int64_t)(m0 + m) * N + b * 16), (__m256i)_mm512_cvtneps_pbh(out));
    }
}

/* Whether tiles of KIND have an AMX form (groups of 16 do not: their sums run over 16 inputs). */
#define AMX_KIND(KIND) ((KIND) == INT4_I8 || (KIND) == INT5_I8 || (KIND) == INT8_I8 || (KIND) == INT8G_I8)

/* Blocks [b0, b0 + nb), rows [m0, m0 + 16 * tiles): block by block, a 4- or 5-bit block widened once into
 * `widened` ([K/4][64] bytes) for all its row tiles. */
ALWAYS_INLINE void amx_columns(const uint8_t *packed, const void *scales, const int8_t *xq, const float *xd,
                               const float *xsum, const float *xqsum, uint16_t *y, int64_t b0, int nb, int m0,
                               int tiles, int K, int G, int group, int N, uint8_t *widened, const enum kind KIND) {
    for (int64_t b = b0; b < b0 + nb; b++) {
        const uint8_t *weights = packed + b * (K / 4) * 64;
        if (KIND == INT4_I8 || KIND == INT5_I8) {
            amx_widen(packed, widened, b, K, KIND == INT5_I8 ? 5 : 4);
            weights = widened;
        }
        for (int t = 0; t < tiles; t++)
            amx_tile(weights, scales, xq, xd, xsum, xqsum, y, b, m0 + 16 * t, K, G, group, N, KIND);
    }
    amx_tile_count += (int64_t)nb * tiles;
}
#else
#define AMX_KIND(KIND) 0
static int amx_permitted(void) { return 0; }
static int64_t amx_tile_count;
#endif

#endif
