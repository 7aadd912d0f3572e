/* Every function the shared library exports, as engine/cpu_kernels.py declares them to ctypes.
 * Functions returning int return a PC_* code (common.h). */
#pragma once
#include <stdint.h>

/* pagedchat_features(): which vectorised paths this build has (the rest answer PC_UNSUPPORTED). */
#define PC_FEATURE_BF16_ATTENTION 1 /* AVX-512 BF16: paged_decode_attention's bf16 path, prefix_attention */
#define PC_FEATURE_QUANT_BF16 2     /* AVX-512 BF16 + VNNI: int4_matmul, int8_matmul and their _i8 forms */
#define PC_FEATURE_QUANT_F32 4      /* AVX2 + FMA: int4_matmul_f32, int8_matmul_f32 and their _i8 forms */
#define PC_FEATURE_F32_ATTENTION 8  /* AVX2 + FMA: paged_decode_attention's vectorised fp32 path */
#define PC_FEATURE_AMX_TILES 16     /* AMX-INT8, lent by Linux: the _i8 kernels' amx (quant_amx.h) */
#define PC_FEATURE_AMX_BF16_TILES 32 /* AMX-BF16, lent by Linux: int4_matmul_bf16_tiles (quant_amx_bf16.h) */
int pagedchat_features(void);

int paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, void *out,
                           const int64_t *block_tables, const int64_t *seq_lens, const int64_t *starts,
                           const int64_t *prefix_row, const float *prefix_out, const float *prefix_lse, int B,
                           int H, int Hkv, int D, int block_size, int max_blocks, float scale, int dtype,
                           int threads);
void kv_store(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache, void *v_cache,
              const int64_t *slots, int64_t T, int Hkv, int D, int block_size, int dtype, int threads);
void kv_store_int8(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_pool, void *v_pool,
                   const int64_t *slots, int64_t T, int Hkv, int D, int block_size, int dtype, int threads);
int prefix_attention(const void *q, int64_t q_stride, const void *kt, const void *vp, float *out, float *lse,
                     int S, int H, int Hkv, int D, int64_t P, float scale, int threads);
void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int n, float eps,
              int dtype, int threads);
void rms_norm_heads(const void *x, int64_t x_stride, const void *weight, void *out, int64_t tokens, int heads, int n,
                    float eps, int dtype, int threads);
void silu_and_mul(const void *x, void *out, int64_t rows, int n, int dtype, int threads);
void rotary_neox(void *q, void *k, int64_t q_stride, int64_t k_stride, const float *cos, const float *sin,
                 const int64_t *positions, int64_t T, int Hq, int Hk, int D, int dtype);
void argmax_rows(const float *x, int64_t *out, int64_t rows, int64_t n, int threads);
int int8_rows_lookup(const uint8_t *packed, const float *scales, const int64_t *ids, void *out, int64_t n, int N,
                     int K, int dtype); /* embedding.c: PC_BAD_SHAPE for an id outside [0, N) */
int int4_matmul(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                int threads);
/* The _i8 kernels' amx: whole tiles of 16 rows take AMX tiles where amx_tiles() (same results). */
int int4_matmul_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                   int threads, int amx);
int int5_matmul_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                   int threads, int amx);
int int8_matmul(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int threads);
int int8_matmul_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int threads,
                   int amx);
int int8g_matmul_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                    int threads, int amx);
int amx_tiles(void);                 /* whether this build has AMX-INT8 tiles and Linux lends them to this process */
int64_t amx_tiles_computed(void);    /* how many tiles of 16 rows by 16 columns they have computed */
int amx_bf16_tiles(void);            /* whether this build has AMX-BF16 tiles and Linux lends them */
int int4_matmul_bf16_tiles(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N,
                           int group, int threads);
int int4_matmul_f32(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                    int threads);
int int8_matmul_f32(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N,
                    int threads);
/* fp32 rows rounded to int8 per 32 inputs (AVX2: vpmaddubsw), the packed bytes of int4_matmul_i8 and int8_matmul_i8
 * with quant_matmul_f32.c's scales (csrc/quant_int8_rows_f32.c) */
int int4_matmul_f32_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N, int group,
                       int threads);
int int8_matmul_f32_i8(const void *x, const void *packed, const void *scales, void *y, int M, int K, int N,
                       int threads);

/* decoder_layers (decoder.c): a Llama-family decoder stack in one call; engine/fused_layers.py mirrors these
 * field numbers. A layer: its norms' weights (the q and k norms 0 where it has none), its K and V pools, its
 * linears. A linear: its kernel (PC_INT4...), packed weight, scales, N, K, group, amx_from, tiles_from, bias
 * (0: none; else [N] in the rows' dtype). */
enum { PC_INT4, PC_INT4_I8, PC_INT4_F32, PC_INT4_F32_I8, PC_INT5_I8, PC_INT8, PC_INT8_I8, PC_INT8_F32,
       PC_INT8_F32_I8, PC_INT8G_I8 };
enum { PC_LINEAR_KIND, PC_LINEAR_PACKED, PC_LINEAR_SCALES, PC_LINEAR_N, PC_LINEAR_K, PC_LINEAR_GROUP,
       PC_LINEAR_AMX_FROM, PC_LINEAR_TILES_FROM, PC_LINEAR_BIAS, PC_LINEAR_FIELDS };
enum { PC_LAYER_INPUT_NORM, PC_LAYER_POST_NORM, PC_LAYER_Q_NORM, PC_LAYER_K_NORM, PC_LAYER_K_CACHE, PC_LAYER_V_CACHE,
       PC_LAYER_QKV, PC_LAYER_O = PC_LAYER_QKV + PC_LINEAR_FIELDS, PC_LAYER_GATE_UP = PC_LAYER_O + PC_LINEAR_FIELDS,
       PC_LAYER_DOWN = PC_LAYER_GATE_UP + PC_LINEAR_FIELDS, PC_LAYER_FIELDS = PC_LAYER_DOWN + PC_LINEAR_FIELDS };
/* A cascade: how many rows share the prefix, its tokens, the rows (int64 [S]), starts and prefix_row (int64 [M]),
 * then from PC_CASCADE_OPERANDS on the prefix's K and V per layer (pointers, [L, 2]) */
enum { PC_CASCADE_ROWS, PC_CASCADE_TOKENS, PC_CASCADE_ROW_IDS, PC_CASCADE_STARTS, PC_CASCADE_PREFIX_ROW,
       PC_CASCADE_OPERANDS };
int decoder_layers(const int64_t *layers, int L, const int64_t *shape, void *h, void *out, int M,
                   const int64_t *positions, const float *cos, const float *sin, const int64_t *slots,
                   const int64_t *block_tables, const int64_t *seq_lens, int max_blocks, float eps, float scale,
                   int threads, int attention_threads, const int64_t *cascade);
