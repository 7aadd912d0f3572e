/* A Llama-family decoder stack in one call (engine/fused_layers.py). For each layer it calls the kernels
 * the model's modules call one by one (rms_norm, the packed linears, rotary_neox, kv_store,
 * paged_decode_attention, silu_and_mul), in the same order with the same arguments, so a step computes
 * the same bits either way; what goes is the Python between them: thirty layers of module calls,
 * ctypes glue and tensor views, about 4 ms a step of the default model whatever its rows.
 *
 * It serves steps whose rows are all attended one by one (decodes, drafts, prompt chunks), where every
 * linear would take one of our packed kernels for all the step's rows; with a cascade (engine/cascade.py)
 * where prefix_attention serves it.
 *
 * layers [L, PC_LAYER_FIELDS] int64 (kernels.h): per layer the two norms' weights, the q and k norms' (Qwen3;
 * 0: none), the K and V pools, and the qkv, o, gate_up and down linears (PC_LINEAR_FIELDS each). shape:
 * hidden, H, Hkv, D, dtype (0 fp32, 1 bf16), kv_int8, block_size. h [M, hidden]: the embeddings in, the
 * residual stream out (in place, as the modules do); out [M, hidden]: the last layer's MLP output. The
 * final norm is the caller's.
 * cascade: NULL, or int64 fields (kernels.h's PC_CASCADE_*): the S rows that share a prefix of P tokens, each
 * row's first own token and row among them (paged_decode_attention's starts and prefix_row), and per layer
 * the prefix's K and V laid out for prefix_attention.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

static int matmul(const int64_t *l, const void *x, void *y, int M, int threads) {
    const void *p = (const void *)l[PC_LINEAR_PACKED], *s = (const void *)l[PC_LINEAR_SCALES];
    const int N = (int)l[PC_LINEAR_N], K = (int)l[PC_LINEAR_K], g = (int)l[PC_LINEAR_GROUP];
    if (l[PC_LINEAR_TILES_FROM] > 0 && M >= l[PC_LINEAR_TILES_FROM])
        return int4_matmul_bf16_tiles(x, p, s, y, M, K, N, g, threads);
    const int amx = l[PC_LINEAR_AMX_FROM] > 0 && M >= l[PC_LINEAR_AMX_FROM];
    switch (l[PC_LINEAR_KIND]) {
    case PC_INT4: return int4_matmul(x, p, s, y, M, K, N, g, threads);
    case PC_INT4_I8: return int4_matmul_i8(x, p, s, y, M, K, N, g, threads, amx);
    case PC_INT4_F32: return int4_matmul_f32(x, p, s, y, M, K, N, g, threads);
    case PC_INT4_F32_I8: return int4_matmul_f32_i8(x, p, s, y, M, K, N, g, threads);
    case PC_INT5_I8: return int5_matmul_i8(x, p, s, y, M, K, N, g, threads, amx);
    case PC_INT8: return int8_matmul(x, p, s, y, M, K, N, threads);
    case PC_INT8_I8: return int8_matmul_i8(x, p, s, y, M, K, N, threads, amx);
    case PC_INT8_F32: return int8_matmul_f32(x, p, s, y, M, K, N, threads);
    case PC_INT8_F32_I8: return int8_matmul_f32_i8(x, p, s, y, M, K, N, threads);
    case PC_INT8G_I8: return int8g_matmul_i8(x, p, s, y, M, K, N, g, threads, amx);
    }
    return PC_BAD_SHAPE;
}

/* y = x W^T (+ b) by the kernel the linear's Python kernel would call for M rows (engine/quant/kernels.py),
 * the bias added as torch adds it (in fp32, rounded to the dtype). */
static int linear(const int64_t *l, const void *x, void *y, int M, int dtype, int threads) {
    const int code = matmul(l, x, y, M, threads);
    const int64_t N = l[PC_LINEAR_N];
    if (code || !l[PC_LINEAR_BIAS]) return code;
    const float *bias_f32 = (const float *)l[PC_LINEAR_BIAS];
    const uint16_t *bias_bf16 = (const uint16_t *)l[PC_LINEAR_BIAS];
    float *y_f32 = y;
    uint16_t *y_bf16 = y;
    for (int64_t i = 0; i < M * N; i++) {
        if (dtype == 0) y_f32[i] += bias_f32[i % N];
        else y_bf16[i] = f32_to_bf16(bf16_to_f32(y_bf16[i]) + bf16_to_f32(bias_bf16[i % N]));
    }
    return PC_OK;
}

/* n elements of `size` bytes rounded up to whole cache lines */
static int64_t lines(int64_t n, int64_t size) { return (n * size + 63) / 64 * 64; }

int decoder_layers(const int64_t *layers, int L, const int64_t *shape, void *h, void *out, int M,
                   const int64_t *positions, const float *cos, const float *sin, const int64_t *slots,
                   const int64_t *block_tables, const int64_t *seq_lens, int max_blocks, float eps, float scale,
                   int threads, int attention_threads, const int64_t *cascade) {
    const int hidden = (int)shape[0], H = (int)shape[1], Hkv = (int)shape[2], D = (int)shape[3];
    const int dtype = (int)shape[4], kv_int8 = (int)shape[5], block_size = (int)shape[6];
    const int64_t size = dtype ? 2 : 4, q_width = (int64_t)H * D, qkv_width = q_width + 2 * (int64_t)Hkv * D;
    const int inter = (int)(layers[PC_LAYER_GATE_UP + PC_LINEAR_N] / 2);
    const int attention_dtype = kv_int8 ? (dtype ? 2 : 3) : dtype; /* paged_attention.c's codes */
    const int64_t x_bytes = lines((int64_t)M * hidden, size), qkv_bytes = lines(M * qkv_width, size),
                  attn_bytes = lines(M * q_width, size), up_bytes = lines((int64_t)M * 2 * inter, size),
                  act_bytes = lines((int64_t)M * inter, size);
    const int64_t qk_bytes = layers[PC_LAYER_Q_NORM] ? lines(M * (q_width + (int64_t)Hkv * D), size) : 0;
    const int S = cascade ? (int)cascade[PC_CASCADE_ROWS] : 0;
    const int64_t *shared_rows = cascade ? (const int64_t *)cascade[PC_CASCADE_ROW_IDS] : NULL;
    const int64_t *starts = cascade ? (const int64_t *)cascade[PC_CASCADE_STARTS] : NULL;
    const int64_t *prefix_row = cascade ? (const int64_t *)cascade[PC_CASCADE_PREFIX_ROW] : NULL;
    const int64_t *operands = cascade ? cascade + PC_CASCADE_OPERANDS : NULL;
    const int64_t shared_q_bytes = lines((int64_t)S * q_width, size), prefix_bytes = lines((int64_t)S * q_width, 4);
    char *work = aligned_alloc(64, x_bytes + qkv_bytes + attn_bytes + x_bytes + up_bytes + act_bytes + qk_bytes +
                                       shared_q_bytes + prefix_bytes + lines((int64_t)S * H, 4));
    if (!work) return PC_NO_MEMORY;
    char *x = work, *qkv = x + x_bytes, *attn = qkv + qkv_bytes, *o = attn + attn_bytes, *up = o + x_bytes;
    char *act = up + up_bytes, *normed = act + act_bytes, *shared_q = normed + qk_bytes;
    float *prefix_out = (float *)(shared_q + shared_q_bytes);
    float *prefix_lse = (float *)((char *)prefix_out + prefix_bytes);
    int code = PC_OK;
    for (int l = 0; l < L && !code; l++) {
        const int64_t *layer = layers + (int64_t)l * PC_LAYER_FIELDS;
        void *k_cache = (void *)layer[PC_LAYER_K_CACHE], *v_cache = (void *)layer[PC_LAYER_V_CACHE];
        /* the residual stream starts as the embeddings; later layers add the last MLP's output first */
        rms_norm(l ? out : h, l ? h : NULL, (const void *)layer[PC_LAYER_INPUT_NORM], x, M, hidden, eps, dtype,
                 threads);
        if ((code = linear(layer + PC_LAYER_QKV, x, qkv, M, dtype, threads))) break;
        char *q = qkv, *k = qkv + q_width * size, *v = k + (int64_t)Hkv * D * size;
        int64_t q_stride = qkv_width, k_stride = qkv_width;
        if (layer[PC_LAYER_Q_NORM]) { /* as the modules' q_norm and k_norm: into rows of their own */
            rms_norm_heads(q, q_stride, (const void *)layer[PC_LAYER_Q_NORM], normed, M, H, D, eps, dtype, threads);
            rms_norm_heads(k, k_stride, (const void *)layer[PC_LAYER_K_NORM], normed + M * q_width * size, M, Hkv, D,
                           eps, dtype, threads);
            q = normed, k = normed + M * q_width * size, q_stride = q_width, k_stride = (int64_t)Hkv * D;
        }
        rotary_neox(q, k, q_stride, k_stride, cos, sin, positions, M, H, Hkv, D, dtype);
        if (kv_int8)
            kv_store_int8(k, k_stride, v, qkv_width, k_cache, v_cache, slots, M, Hkv, D, block_size, dtype, threads);
        else
            kv_store(k, k_stride, v, qkv_width, k_cache, v_cache, slots, M, Hkv, D, block_size, dtype, threads);
        if (S) { /* the cascade's prefix side as attention.py's _cascade_prefix: the sharing rows' queries */
            for (int r = 0; r < S; r++)
                memcpy(shared_q + r * q_width * size, q + shared_rows[r] * q_stride * size, q_width * size);
            const void *keys = (const void *)operands[2 * l], *values = (const void *)operands[2 * l + 1];
            code = prefix_attention(shared_q, q_width, keys, values, prefix_out, prefix_lse, S, H, Hkv, D,
                                    cascade[PC_CASCADE_TOKENS], scale, attention_threads);
            if (code) break;
        }
        code = paged_decode_attention(q, q_stride, k_cache, v_cache, attn, block_tables, seq_lens, starts,
                                      prefix_row, S ? prefix_out : NULL, S ? prefix_lse : NULL, M, H, Hkv, D,
                                      block_size, max_blocks, scale, attention_dtype, attention_threads);
        if (code || (code = linear(layer + PC_LAYER_O, attn, o, M, dtype, threads))) break;
        rms_norm(o, h, (const void *)layer[PC_LAYER_POST_NORM], x, M, hidden, eps, dtype, threads);
        if ((code = linear(layer + PC_LAYER_GATE_UP, x, up, M, dtype, threads))) break;
        silu_and_mul(up, act, M, inter, dtype, threads);
        code = linear(layer + PC_LAYER_DOWN, act, out, M, dtype, threads);
    }
    free(work);
    return code;
}
