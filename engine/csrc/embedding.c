/* The embedding lookup of a model whose LM head is tied to it and packed as int8 rows (engine/quant/kernels.py's
 * PackedEmbedding): each token's row read from the head's layout, [N/16, K/4, 64] uint8 (q + 128, each quad's k
 * in the order 0, 2, 1, 3), times its fp32 scale, rounded to the model's dtype as torch rounds (the same bits as
 * the torch path's eight indexing and casting ops, which took 264 us of a 7 ms one-session step here).
 * dtype: 0 = float32, 1 = bfloat16. */
#include <stdint.h>

#include "common.h"
#include "kernels.h"

int int8_rows_lookup(const uint8_t *packed, const float *scales, const int64_t *ids, void *out, int64_t n, int N,
                     int K, int dtype) {
    static const int order[4] = {0, 2, 1, 3};
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return PC_BAD_SHAPE;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        const uint8_t *row = packed + (id / 16) * (int64_t)K * 16 + (id % 16) * 4;
        const float scale = scales[id];
        for (int p = 0; p < K / 4; p++)
            for (int j = 0; j < 4; j++) {
                const float w = (float)((int)row[p * 64 + order[j]] - 128) * scale;
                if (dtype == 0) ((float *)out)[i * K + 4 * p + j] = w;
                else ((uint16_t *)out)[i * K + 4 * p + j] = f32_to_bf16(w);
            }
    }
    return PC_OK;
}
