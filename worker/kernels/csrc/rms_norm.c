/* RMSNorm of float32 or bfloat16 rows on the CPU, optionally after the residual add before it:
 *
 *     residual[r] = x[r] + residual[r]                       (when residual is given; in place)
 *     out[r] = weight * (y[r] / sqrt(mean(y[r]^2) + eps))   y = the residual, else x
 *
 * torch runs this as seven operators in bfloat16 (the add, a cast up, pow, mean, rsqrt,
 * multiply, a cast down, the weight's multiply), and each costs its dispatch and thread barrier:
 * at one decode row of 576 values ~20 us a norm, 61 norms a SmolLM2 step. Here one pass reads
 * the row twice and writes it once or twice. In bfloat16 every rounding torch (and transformers)
 * makes is made here too: the sum rounded to bfloat16, the normalised value rounded before the
 * weight's multiply, the product rounded; the arithmetic in between is float32.
 * Rows are split across threads only when there are enough of them to pay for it.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "norm.h"

static inline __attribute__((always_inline)) void norm_rows(
        const void *x, int64_t x_stride, void *residual, const void *weight, void *out, int num_rows, int dim,
        float eps, const int bf16) {
#pragma omp for schedule(static)
    for (int r = 0; r < num_rows; r++) {
        float row[dim];
        for (int d = 0; d < dim; d++) {
            const int64_t i = r * x_stride + d;
            row[d] = bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
        }
        if (residual != 0) {
            for (int d = 0; d < dim; d++) {
                const int64_t i = (int64_t)r * dim + d;
                if (bf16) {
                    const uint16_t sum = f32_to_bf16(row[d] + bf16_to_f32(((uint16_t *)residual)[i]));
                    ((uint16_t *)residual)[i] = sum;
                    row[d] = bf16_to_f32(sum);
                } else {
                    row[d] += ((float *)residual)[i];
                    ((float *)residual)[i] = row[d];
                }
            }
        }
        norm_vector(row, weight, out, (int64_t)r * dim, dim, eps, bf16);
    }
}

/* residual may be NULL (no add). x rows are x_stride elements apart; residual and out are
 * contiguous [num_rows, dim]. */
void rms_norm_rows_f32(const float *x, int64_t x_stride, float *residual, const float *weight, float *out,
                       int num_rows, int dim, float eps) {
    norm_rows(x, x_stride, residual, weight, out, num_rows, dim, eps, 0);
}

void rms_norm_rows_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual, const uint16_t *weight,
                        uint16_t *out, int num_rows, int dim, float eps) {
    norm_rows(x, x_stride, residual, weight, out, num_rows, dim, eps, 1);
}

void rms_norm(const float *x, int64_t x_stride, float *residual, const float *weight, float *out, int num_rows,
              int dim, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (num_rows >= 16)
    rms_norm_rows_f32(x, x_stride, residual, weight, out, num_rows, dim, eps);
}

void rms_norm_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual, const uint16_t *weight, uint16_t *out,
                   int num_rows, int dim, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (num_rows >= 16)
    rms_norm_rows_bf16(x, x_stride, residual, weight, out, num_rows, dim, eps);
}
