/* Which vectorised paths this build was compiled with, so Python asks once instead of probing
 * kernels with empty arguments. */
#include "common.h"
#include "kernels.h"

int pagedchat_features(void) {
    int features = 0;
#ifdef PC_AVX512_BF16
    features |= PC_FEATURE_BF16_ATTENTION;
#endif
#ifdef PC_AVX512_BF16_VNNI
    features |= PC_FEATURE_QUANT_BF16;
#endif
    if (amx_tiles()) features |= PC_FEATURE_AMX_TILES;
    if (amx_bf16_tiles()) features |= PC_FEATURE_AMX_BF16_TILES;
#ifdef PC_AVX2_FMA
    features |= PC_FEATURE_QUANT_F32 | PC_FEATURE_F32_ATTENTION;
#endif
    return features;
}
