/* RMSNorm of float32 rows on the CPU: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight.
 *
 * torch's F.rms_norm runs as six operators on the CPU (pow, mean, add, rsqrt, two multiplies);
 * at one decode row of 576 values each costs its dispatch and thread barrier, ~35 us a norm,
 * 2 ms of a 27 ms SmolLM2 step (61 norms). One pass here reads the row twice and writes it once.
 * Rows are split across threads only when there are enough of them to pay for it.
 */
#include <math.h>
#include <stdint.h>

void rms_norm(const float *x, int64_t x_stride, const float *weight, float *out, int num_rows, int dim,
              float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows >= 16)
    for (int r = 0; r < num_rows; r++) {
        const float *row = x + r * x_stride;
        float sum = 0.0f;
        for (int d = 0; d < dim; d++) sum += row[d] * row[d];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        float *o = out + (int64_t)r * dim;
        for (int d = 0; d < dim; d++) o[d] = row[d] * inv * weight[d];
    }
}
