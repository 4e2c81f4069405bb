/* Decode attention straight from the paged KV cache (float32 or bfloat16, CPU).
 *
 * One query token per row. Each row first writes its new key and value into its cache slot,
 * then each (row, kv head) pair attends over the row's context block by block, reading keys
 * and values where they lie in the cache: no gathered copy of the context. The G query heads
 * that share a kv head are done together, so each key and value is read once for all of them.
 * Softmax is the streaming kind: a running max and sum per query head, the accumulator
 * rescaled once per block rather than once per position.
 *
 * Built by worker/kernels/cpu.py with the system C compiler (-O3 -march=native -fopenmp, and
 * reassociation allowed so the dot products vectorise; no -ffinite-math: -INFINITY is used);
 * the inner loops over head_dim are plain loops the compiler vectorises.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_GROUP 16      /* query heads per kv head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 128     /* tokens per KV block */

/* Strides are in elements of elem_size bytes (4: float32, 2: bfloat16): the bytes are copied. */
void write_kv(const char *k_new, const char *v_new, int64_t k_stride, int64_t v_stride, char *k_cache,
              char *v_cache, const int64_t *slots, int num_rows, int kv_heads, int head_dim, int elem_size) {
    const int64_t width = (int64_t)kv_heads * head_dim * elem_size;
    for (int b = 0; b < num_rows; b++) {
        memcpy(k_cache + slots[b] * width, k_new + b * k_stride * elem_size, width);
        memcpy(v_cache + slots[b] * width, v_new + b * v_stride * elem_size, width);
    }
}

/* The positions from pos on that lie in pos's block, up to end: how many (*n), and the element
 * offset of the first one's key (or value) for kv head h in the flat cache. */
static inline int64_t block_run(const int32_t *table_row, int pos, int end, int block_size, int64_t slot_width,
                                int64_t head_offset, int *n) {
    const int block = table_row[pos / block_size];
    const int offset = pos % block_size;
    *n = (block_size - offset < end - pos) ? block_size - offset : end - pos;
    return ((int64_t)block * block_size + offset) * slot_width + head_offset;
}

/* Element i of a float32 (bf16 == 0) or bfloat16 (bf16 == 1) array, as a float. */
static inline float load(const void *base, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* q, the caches and out are all float32 or all bfloat16; scores, softmax and the accumulators
 * are float32 either way. Inlined into the two entry points below with bf16 a constant, so each
 * is compiled for its own type with no branch left in the loops. */
static inline __attribute__((always_inline)) void decode_rows(
        const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int32_t *block_table,
        int max_blocks, const int32_t *context_lens, const int32_t *first_positions, void *out, int num_rows,
        int num_heads, int kv_heads, int head_dim, int block_size, float scale, const int bf16) {
    const int group = num_heads / kv_heads;
    const int64_t slot_width = (int64_t)kv_heads * head_dim;
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int b = 0; b < num_rows; b++) {
        for (int h = 0; h < kv_heads; h++) {
            float acc[MAX_GROUP][MAX_HEAD_DIM];
            float qs[MAX_GROUP][MAX_HEAD_DIM];
            float running_max[MAX_GROUP], running_sum[MAX_GROUP];
            float scores[MAX_GROUP][MAX_BLOCK];
            for (int g = 0; g < group; g++) {
                const int64_t qg = b * q_stride + (int64_t)(h * group + g) * head_dim;
                for (int d = 0; d < head_dim; d++) {
                    qs[g][d] = load(q, qg + d, bf16) * scale;
                    acc[g][d] = 0.0f;
                }
                running_max[g] = -INFINITY;
                running_sum[g] = 0.0f;
            }
            const int end = context_lens[b];
            int pos = first_positions[b];
            while (pos < end) {
                int n;
                const int64_t kv_base = block_run(block_table + (int64_t)b * max_blocks, pos, end, block_size,
                                                  slot_width, (int64_t)h * head_dim, &n);
                for (int g = 0; g < group; g++) {
                    float block_max = running_max[g];
                    for (int i = 0; i < n; i++) {
                        const int64_t k = kv_base + i * slot_width;
                        float s = 0.0f;
                        for (int d = 0; d < head_dim; d++) s += qs[g][d] * load(k_cache, k + d, bf16);
                        scores[g][i] = s;
                        if (s > block_max) block_max = s;
                    }
                    const float rescale = expf(running_max[g] - block_max);
                    running_sum[g] *= rescale;
                    for (int d = 0; d < head_dim; d++) acc[g][d] *= rescale;
                    running_max[g] = block_max;
                    for (int i = 0; i < n; i++) {
                        const float p = expf(scores[g][i] - block_max);
                        running_sum[g] += p;
                        const int64_t v = kv_base + i * slot_width;
                        for (int d = 0; d < head_dim; d++) acc[g][d] += p * load(v_cache, v + d, bf16);
                    }
                }
                pos += n;
            }
            for (int g = 0; g < group; g++) {
                const int64_t o = ((int64_t)b * num_heads + h * group + g) * head_dim;
                const float inv = 1.0f / running_sum[g];
                for (int d = 0; d < head_dim; d++) {
                    if (bf16)
                        ((uint16_t *)out)[o + d] = f32_to_bf16(acc[g][d] * inv);
                    else
                        ((float *)out)[o + d] = acc[g][d] * inv;
                }
            }
        }
    }
}

#ifdef __AVX512F__
#include "simd.h"

/* The same attention with AVX-512 intrinsics, for head_dim a multiple of 16 (every common
 * model): a row of keys or values is head_dim / 16 registers, converted from bfloat16 once
 * for all the group's query heads; the block's scores are exponentiated 16 at a time (exp512);
 * the accumulators stay float32. About 3x the plain loops' speed (they reduce a dot product and
 * call expf once per position and head). */

static inline __attribute__((always_inline)) void decode_rows_avx512(
        const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int32_t *block_table,
        int max_blocks, const int32_t *context_lens, const int32_t *first_positions, void *out, int num_rows,
        int num_heads, int kv_heads, int head_dim, int block_size, float scale, const int bf16,
        const int chunks) {
    const int group = num_heads / kv_heads;
    const int64_t slot_width = (int64_t)kv_heads * head_dim;
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int b = 0; b < num_rows; b++) {
        for (int h = 0; h < kv_heads; h++) {
            __m512 qs[MAX_GROUP][MAX_HEAD_DIM / 16], acc[MAX_GROUP][MAX_HEAD_DIM / 16];
            float running_max[MAX_GROUP], running_sum[MAX_GROUP];
            float scores[MAX_GROUP][MAX_BLOCK] __attribute__((aligned(64)));
            for (int g = 0; g < group; g++) {
                const int64_t qg = b * q_stride + (int64_t)(h * group + g) * head_dim;
                for (int c = 0; c < chunks; c++) {
                    qs[g][c] = _mm512_mul_ps(load16(q, qg + 16 * c, bf16), _mm512_set1_ps(scale));
                    acc[g][c] = _mm512_setzero_ps();
                }
                running_max[g] = -INFINITY;
                running_sum[g] = 0.0f;
            }
            const int end = context_lens[b];
            int pos = first_positions[b];
            while (pos < end) {
                int n;
                const int64_t kv_base = block_run(block_table + (int64_t)b * max_blocks, pos, end, block_size,
                                                  slot_width, (int64_t)h * head_dim, &n);
                for (int i = 0; i < n; i++) {
                    __m512 key[MAX_HEAD_DIM / 16];
                    for (int c = 0; c < chunks; c++) key[c] = load16(k_cache, kv_base + i * slot_width + 16 * c, bf16);
                    for (int g = 0; g < group; g++) {
                        __m512 s = _mm512_mul_ps(qs[g][0], key[0]);
                        for (int c = 1; c < chunks; c++) s = _mm512_fmadd_ps(qs[g][c], key[c], s);
                        scores[g][i] = _mm512_reduce_add_ps(s);
                    }
                }
                for (int g = 0; g < group; g++) {
                    float block_max = running_max[g];
                    for (int i = 0; i < n; i++) block_max = scores[g][i] > block_max ? scores[g][i] : block_max;
                    if (block_max > running_max[g]) {
                        const __m512 rescale = _mm512_set1_ps(expf(running_max[g] - block_max));
                        running_sum[g] *= expf(running_max[g] - block_max);
                        for (int c = 0; c < chunks; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], rescale);
                        running_max[g] = block_max;
                    }
                    __m512 sum = _mm512_setzero_ps();
                    for (int i = 0; i < n; i += 16) {
                        const __mmask16 lanes = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
                        const __m512 s = _mm512_maskz_loadu_ps(lanes, &scores[g][i]);
                        const __m512 p = _mm512_maskz_mov_ps(lanes, exp512(_mm512_sub_ps(s, _mm512_set1_ps(block_max))));
                        _mm512_mask_storeu_ps(&scores[g][i], lanes, p);
                        sum = _mm512_add_ps(sum, p);
                    }
                    running_sum[g] += _mm512_reduce_add_ps(sum);
                }
                for (int i = 0; i < n; i++) {
                    __m512 value[MAX_HEAD_DIM / 16];
                    for (int c = 0; c < chunks; c++) value[c] = load16(v_cache, kv_base + i * slot_width + 16 * c, bf16);
                    for (int g = 0; g < group; g++) {
                        const __m512 p = _mm512_set1_ps(scores[g][i]);
                        for (int c = 0; c < chunks; c++) acc[g][c] = _mm512_fmadd_ps(p, value[c], acc[g][c]);
                    }
                }
                pos += n;
            }
            for (int g = 0; g < group; g++) {
                const int64_t o = ((int64_t)b * num_heads + h * group + g) * head_dim;
                const __m512 inv = _mm512_set1_ps(1.0f / running_sum[g]);
                for (int c = 0; c < chunks; c++) store16(out, o + 16 * c, _mm512_mul_ps(acc[g][c], inv), bf16);
            }
        }
    }
}
#define HAVE_AVX512_DECODE 1
#else
#define HAVE_AVX512_DECODE 0
#endif

/* The AVX-512 path where it applies (common head sizes with constant trip counts), else the plain
 * loops; inlined into both entry points with bf16 a constant. */
static inline __attribute__((always_inline)) void decode(
        const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int32_t *block_table,
        int max_blocks, const int32_t *context_lens, const int32_t *first_positions, void *out, int num_rows,
        int num_heads, int kv_heads, int head_dim, int block_size, float scale, const int bf16) {
#if HAVE_AVX512_DECODE
    if (head_dim % 16 == 0) {
        const int chunks = head_dim / 16;
        if (chunks == 2)
            decode_rows_avx512(q, q_stride, k_cache, v_cache, block_table, max_blocks, context_lens, first_positions,
                               out, num_rows, num_heads, kv_heads, head_dim, block_size, scale, bf16, 2);
        else if (chunks == 4)
            decode_rows_avx512(q, q_stride, k_cache, v_cache, block_table, max_blocks, context_lens, first_positions,
                               out, num_rows, num_heads, kv_heads, head_dim, block_size, scale, bf16, 4);
        else if (chunks == 8)
            decode_rows_avx512(q, q_stride, k_cache, v_cache, block_table, max_blocks, context_lens, first_positions,
                               out, num_rows, num_heads, kv_heads, head_dim, block_size, scale, bf16, 8);
        else
            decode_rows_avx512(q, q_stride, k_cache, v_cache, block_table, max_blocks, context_lens, first_positions,
                               out, num_rows, num_heads, kv_heads, head_dim, block_size, scale, bf16,
                               chunks);
        return;
    }
#endif
    decode_rows(q, q_stride, k_cache, v_cache, block_table, max_blocks, context_lens, first_positions, out,
                num_rows, num_heads, kv_heads, head_dim, block_size, scale, bf16);
}

/* The work-sharing bodies: inside an enclosing parallel region (decoder.c's layer loop) they
 * share its threads; called outside one, a single thread does every row. */
void paged_decode_rows_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                           const int32_t *block_table, int max_blocks, const int32_t *context_lens,
                           const int32_t *first_positions, float *out, int num_rows, int num_heads, int kv_heads,
                           int head_dim, int block_size, float scale) {
    decode(q, q_stride, k_cache, v_cache, block_table, max_blocks, context_lens, first_positions, out, num_rows,
           num_heads, kv_heads, head_dim, block_size, scale, 0);
}

void paged_decode_rows_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int32_t *block_table, int max_blocks, const int32_t *context_lens,
                            const int32_t *first_positions, uint16_t *out, int num_rows, int num_heads, int kv_heads,
                            int head_dim, int block_size, float scale) {
    decode(q, q_stride, k_cache, v_cache, block_table, max_blocks, context_lens, first_positions, out, num_rows,
           num_heads, kv_heads, head_dim, block_size, scale, 1);
}

void paged_decode(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                  const int32_t *block_table, int max_blocks, const int32_t *context_lens,
                  const int32_t *first_positions, float *out, int num_rows, int num_heads,
                  int kv_heads, int head_dim, int block_size, float scale, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    paged_decode_rows_f32(q, q_stride, k_cache, v_cache, block_table, max_blocks, context_lens, first_positions, out,
                          num_rows, num_heads, kv_heads, head_dim, block_size, scale);
}

void paged_decode_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int32_t *block_table, int max_blocks, const int32_t *context_lens,
                       const int32_t *first_positions, uint16_t *out, int num_rows, int num_heads,
                       int kv_heads, int head_dim, int block_size, float scale, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    paged_decode_rows_bf16(q, q_stride, k_cache, v_cache, block_table, max_blocks, context_lens, first_positions, out,
                           num_rows, num_heads, kv_heads, head_dim, block_size, scale);
}
