/* RMSNorm for the CPU, one pass per row, with transformers' arithmetic: the row normalised in fp32,
 * rounded to the model's dtype, then multiplied by the weight in that dtype. On a 64-row decode batch
 * torch's eight separate ops cost ~0.35 ms here; this is one call.
 *
 * x, out [rows, n] and weight [n], contiguous; dtype: 0 = float32, 1 = bfloat16 (all share it).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

void rms_norm(const void *x, const void *weight, void *out, int64_t rows, int n, float eps, int dtype, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        float sum = 0.f;
        if (dtype == 0) {
            const float *xr = (const float *)x + r * n, *w = weight;
            float *o = (float *)out + r * n;
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < n; i++) sum += xr[i] * xr[i];
            const float inv = 1.f / sqrtf(sum / n + eps);
            for (int i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
        } else {
            const uint16_t *xr = (const uint16_t *)x + r * n, *w = weight;
            uint16_t *o = (uint16_t *)out + r * n;
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < n; i++) { const float v = bf16_f32(xr[i]); sum += v * v; }
            const float inv = 1.f / sqrtf(sum / n + eps);
#pragma omp simd
            for (int i = 0; i < n; i++) o[i] = f32_bf16(bf16_f32(w[i]) * bf16_f32(f32_bf16(bf16_f32(xr[i]) * inv)));
        }
    }
}
