/* Writing the new tokens' K and V into their slots of the block pool: as they are (bf16 or fp32 caches),
 * or rounded to int8 per token and head (--kv-cache-dtype int8). Layouts: paged_attention.c's and
 * attention_int8.h's. */
#include <stdint.h>
#include <string.h>

#include "attention_int8.h"
#include "common.h"
#include "kernels.h"
#include "pool.h"

struct job {
    const char *k, *v;
    int64_t k_stride, v_stride;
    void *k_cache, *v_cache;
    const int64_t *slots;
    int64_t T;
    int Hkv, D, block_size, dtype;
};

/* The new tokens' K and V (row strides k_stride, v_stride elements; each row's Hkv * D elements
 * contiguous) into their cache slots: V as whole rows ([slots, Hkv, D]), K as dimension pairs
 * ([blocks, Hkv, D/2, block_size, 2]). One call instead of two index_copy_ (~20 us each at 64 rows). */
static void store_part(void *ctx, int part, int parts) {
    const struct job *j = ctx;
    const int64_t size = j->dtype == 0 ? 4 : 2, W = (int64_t)j->Hkv * j->D, bs = j->block_size;
    for (int64_t t = pool_share(j->T, part, parts), end = pool_share(j->T, part + 1, parts); t < end; t++) {
        const int64_t slot = j->slots[t];
        memcpy((char *)j->v_cache + slot * W * size, j->v + t * j->v_stride * size, W * size);
        const char *src = j->k + t * j->k_stride * size;
        char *dst = (char *)j->k_cache + (slot / bs * W * bs + slot % bs * 2) * size;
        const int64_t step = 2 * bs * size; /* the pairs of all heads lie block_size pairs apart */
        if (j->dtype == 0) /* constant sizes: each copy one move, not a call */
            for (int64_t pair = 0; pair < W / 2; pair++) memcpy(dst + pair * step, src + pair * 8, 8);
        else
            for (int64_t pair = 0; pair < W / 2; pair++) memcpy(dst + pair * step, src + pair * 4, 4);
    }
}

/* kv_store for int8 caches (attention_int8.h's layouts): each new token's K and V row of each head rounded
 * to int8 with its scale; k and v fp32 (dtype 0) or bf16 (1), D <= 512. */
static void store_int8_part(void *ctx, int part, int parts) {
    const struct job *j = ctx;
    const int64_t size = j->dtype == 0 ? 4 : 2, D = j->D, bs = j->block_size, Hkv = j->Hkv;
    const int64_t block_bytes = Hkv * bs * (D + 4);
    int8_t row[512];
    for (int64_t t = pool_share(j->T, part, parts), end = pool_share(j->T, part + 1, parts); t < end; t++) {
        const int64_t block = j->slots[t] / bs, within = j->slots[t] % bs;
        uint8_t *kb = (uint8_t *)j->k_cache + block * block_bytes, *vb = (uint8_t *)j->v_cache + block * block_bytes;
        float *k_scales = (float *)(kb + Hkv * D * bs), *v_scales = (float *)(vb + Hkv * D * bs);
        for (int h = 0; h < Hkv; h++) {
            v_scales[within * Hkv + h] = quantize_head(j->v + (t * j->v_stride + h * D) * size, j->dtype, (int)D,
                                                       (int8_t *)vb + (within * Hkv + h) * D);
            k_scales[h * bs + within] = quantize_head(j->k + (t * j->k_stride + h * D) * size, j->dtype, (int)D, row);
            int8_t *kh = (int8_t *)kb + h * D * bs + within * 4; /* [D/4, block_size, 4] */
            for (int p = 0; p < D / 4; p++) memcpy(kh + p * 4 * bs, row + 4 * p, 4);
        }
    }
}

/* Tokens split over the pool's threads: a token's K lands in one cache line per dimension pair (96 lines of
 * a block for SmolLM2), which a decode step's next read finds anywhere in the caches; measured at 64 rows in
 * a step, one thread: 76 us a layer. Each slot is written by one part, so the split changes no bytes. */
#define STORE_THREADS_FROM 8

void kv_store(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache, void *v_cache,
              const int64_t *slots, int64_t T, int Hkv, int D, int block_size, int dtype, int threads) {
    struct job j = {k, v, k_stride, v_stride, k_cache, v_cache, slots, T, Hkv, D, block_size, dtype};
    pool_run(T >= STORE_THREADS_FROM ? threads : 1, store_part, &j);
}

void kv_store_int8(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_pool, void *v_pool,
                   const int64_t *slots, int64_t T, int Hkv, int D, int block_size, int dtype, int threads) {
    struct job j = {k, v, k_stride, v_stride, k_pool, v_pool, slots, T, Hkv, D, block_size, dtype};
    pool_run(T >= STORE_THREADS_FROM ? threads : 1, store_int8_part, &j);
}
