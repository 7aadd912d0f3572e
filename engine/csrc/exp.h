/* expf that the compiler vectorises: glibc's expf stays a scalar call per element even at -O3
 * (measured: SiLU·mul over 8 x 1536 bf16 took 66 us, against torch's 16). Cephes' range reduction
 * and polynomial, within ~2 ulp of expf; 0 below -87.3, finite (~2^127) above 88.3. */
#pragma once
#include <math.h>
#include <stdint.h>

static inline float exp_f32(float x) {
    float c = x < -87.3f ? -87.3f : x; /* not fminf/fmaxf: they keep the loop scalar */
    c = c > 88.3f ? 88.3f : c;
    const float k = rintf(c * 1.44269504088896341f);
    float r = fmaf(k, -0.693359375f, c);
    r = fmaf(k, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.f;
    union { uint32_t u; float f; } scale = {(uint32_t)((int32_t)k + 127) << 23};
    return x < -87.3f ? 0.f : p * scale.f;
}
