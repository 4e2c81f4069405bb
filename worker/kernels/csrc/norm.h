/* One vector's RMSNorm, shared by rms_norm.c's rows and decoder.c's per-head norms (Qwen3's q/k
 * norms), so both paths give the same bits:
 *
 *     out[d] = weight[d] * (row[d] / sqrt(mean(row^2) + eps))
 *
 * row: the vector's values, already read as float32 (a bfloat16 row widened); out: float32 or
 * bfloat16 at element offset o, rounded as torch and transformers round it (see rms_norm.c). */
#ifndef SLUICE_NORM_H
#define SLUICE_NORM_H

#include <math.h>
#include <stdint.h>

#include "bf16.h"

static inline __attribute__((always_inline)) void norm_vector(const float *row, const void *weight, void *out,
                                                              int64_t o, int dim, float eps, const int bf16) {
    float sum = 0.0f;
    for (int d = 0; d < dim; d++) sum += row[d] * row[d];
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int d = 0; d < dim; d++) {
        if (bf16) {
            const float normed = bf16_to_f32(f32_to_bf16(row[d] * inv));
            ((uint16_t *)out)[o + d] = f32_to_bf16(bf16_to_f32(((const uint16_t *)weight)[d]) * normed);
        } else {
            ((float *)out)[o + d] = row[d] * inv * ((const float *)weight)[d];
        }
    }
}

#endif
