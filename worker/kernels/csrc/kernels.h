/* The work-sharing bodies of the kernels, for decoder.c: each splits its loop among the threads of
 * the enclosing parallel region (an orphaned `omp for`, with the barrier at its end), so a whole
 * decode step runs in one parallel region instead of one per operator. */
#ifndef SLUICE_KERNELS_H
#define SLUICE_KERNELS_H
#include <stdint.h>

void linear_tiles_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y,
                      int num_rows, int out, int in);
void linear_tiles_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                       int num_rows, int out, int in);
void linear_q_rows(const void *x, int64_t x_stride, const uint8_t *packed, const void *bias, void *y, int num_rows,
                   int out, int in, int format, void *scratch, int bf16);
void store_kv(const void *k_row, const void *v_row, void *k_cache, void *v_cache, int64_t slot, int kv_heads,
              int head_dim, int block_size, int row_size, int cache_size);
void rms_norm_rows_f32(const float *x, int64_t x_stride, float *residual, const float *weight, float *out,
                       int num_rows, int dim, float eps);
void rms_norm_rows_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual, const uint16_t *weight,
                        uint16_t *out, int num_rows, int dim, float eps);
void paged_decode_rows_f32(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int32_t *block_table, int max_blocks, const int32_t *context_lens,
                           const int32_t *first_positions, float *out, int num_rows, int num_heads, int kv_heads,
                           int head_dim, int block_size, float scale, int kv16);
void paged_decode_rows_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int32_t *block_table, int max_blocks, const int32_t *context_lens,
                            const int32_t *first_positions, uint16_t *out, int num_rows, int num_heads, int kv_heads,
                            int head_dim, int block_size, float scale);

#endif
