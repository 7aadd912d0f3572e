/* Writing the new tokens' K and V into their slots of the block pool: as they are (bf16 or fp32 caches),
 * or rounded to int8 per token and head (--kv-cache-dtype int8). Layouts: paged_attention.c's and
 * attention_int8.h's. */
#include <stdint.h>
#include <string.h>

#include "attention_int8.h"
#include "common.h"
#include "kernels.h"

/* The new tokens' K and V (row strides k_stride, v_stride elements; each row's Hkv * D elements
 * contiguous) into their cache slots: V as whole rows ([slots, Hkv, D]), K as dimension pairs
 * ([blocks, Hkv, D/2, block_size, 2]). One call instead of two index_copy_ (~20 us each at 64 rows). */
void kv_store(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache, void *v_cache,
              const int64_t *slots, int64_t T, int Hkv, int D, int block_size, int dtype) {
    const int64_t size = dtype == 0 ? 4 : 2, W = (int64_t)Hkv * D;
    for (int64_t t = 0; t < T; t++) {
        memcpy((char *)v_cache + slots[t] * W * size, (const char *)v + t * v_stride * size, W * size);
        const char *src = (const char *)k + t * k_stride * size;
        char *dst = (char *)k_cache + (slots[t] / block_size * W * block_size + slots[t] % block_size * 2) * size;
        const int64_t step = 2 * block_size * size; /* the pairs of all heads lie block_size pairs apart */
        if (dtype == 0) /* constant sizes: each copy one move, not a call */
            for (int64_t pair = 0; pair < W / 2; pair++) memcpy(dst + pair * step, src + pair * 8, 8);
        else
            for (int64_t pair = 0; pair < W / 2; pair++) memcpy(dst + pair * step, src + pair * 4, 4);
    }
}

/* kv_store for int8 caches (attention_int8.h's layouts): each new token's K and V row of each head rounded
 * to int8 with its scale; k and v fp32 (dtype 0) or bf16 (1), D <= 512. */
void kv_store_int8(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_pool, void *v_pool,
                   const int64_t *slots, int64_t T, int Hkv, int D, int block_size, int dtype) {
    const int64_t size = dtype == 0 ? 4 : 2, block_bytes = (int64_t)Hkv * block_size * (D + 4);
    int8_t row[512];
    for (int64_t t = 0; t < T; t++) {
        const int64_t block = slots[t] / block_size, within = slots[t] % block_size;
        uint8_t *kb = (uint8_t *)k_pool + block * block_bytes, *vb = (uint8_t *)v_pool + block * block_bytes;
        float *k_scales = (float *)(kb + (int64_t)Hkv * D * block_size);
        float *v_scales = (float *)(vb + (int64_t)Hkv * D * block_size);
        for (int h = 0; h < Hkv; h++) {
            v_scales[within * Hkv + h] = quantize_head((const char *)v + (t * v_stride + (int64_t)h * D) * size, dtype,
                                                       D, (int8_t *)vb + (within * Hkv + h) * D);
            k_scales[(int64_t)h * block_size + within] =
                quantize_head((const char *)k + (t * k_stride + (int64_t)h * D) * size, dtype, D, row);
            int8_t *kh = (int8_t *)kb + (int64_t)h * D * block_size + within * 4; /* [D/4, block_size, 4] */
            for (int p = 0; p < D / 4; p++) memcpy(kh + p * 4 * block_size, row + 4 * p, 4);
        }
    }
}
