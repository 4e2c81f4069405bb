/* A decode step's whole decoder stack in one call, on the CPU (float32 or bfloat16), for
 * Llama-family layers whose linears are packed for linear.c:
 *
 *     h = RMSNorm(x + residual)               (the first layer: RMSNorm(x), residual = x)
 *     q, k, v = h W_qkv (+ b);  q, k rotated   (rope, in place; Qwen3 first RMS-normalises each
 *                                              q and k head: norm_heads)
 *     k, v -> the cache slots;  a = paged decode attention of q
 *     h = RMSNorm(a W_o + residual)           (residual updated)
 *     x = (silu(h W_gate) * h W_up) W_down
 *
 * Run per operator from Python, one SmolLM2 layer at one row costs ~160 us beyond its four
 * products (about fifteen torch operators and ctypes calls, each a few microseconds, and a
 * parallel region per kernel): 4.8 of a 14.5 ms step. Here every layer runs inside one parallel
 * region, each stage a work-shared loop (the bodies of linear.c, rms_norm.c and paged_attention.c)
 * ending at a barrier, so a stage costs its arithmetic and a barrier.
 *
 * The rotation and silu(gate) * up are the same functions the per-operator path calls (rope_*,
 * silu_mul_* below), and the other stages are the same bodies: a row gets the same bits whichever
 * path computed it, and whatever the batch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "norm.h"
#include "simd.h"

/* ------------------------------------------------------------------ rotary embedding */

/* Rotate heads [0, n) of each row in place by the row's position (Hugging Face's rotate-half
 * layout): with c, s = cos, sin[position] (float32 tables [positions, head_dim], each half the
 * same angles), d < head_dim / 2:
 *     x[d]        <- x[d] c[d] - x[d + half] s[d]
 *     x[d + half] <- x[d + half] c[d + half] + x[d] s[d + half]
 * each product and the sum rounded to the dtype, in torch's order (x * cos + rotate_half(x) * sin,
 * the tables first cast to the dtype), so the result is bit for bit torch's (the kernels are
 * built with -ffp-contract=off: no product is fused into the sum). */
static inline void rope_row(void *x, int64_t offset, int head_dim, const float *cos_row, const float *sin_row,
                            const int bf16) {
    const int half = head_dim / 2;
    for (int d = 0; d < half; d++) {
        if (bf16) {
            uint16_t *h = (uint16_t *)x + offset;
            const float x1 = bf16_to_f32(h[d]), x2 = bf16_to_f32(h[d + half]);
            const float c1 = bf16_to_f32(f32_to_bf16(cos_row[d])), s1 = bf16_to_f32(f32_to_bf16(sin_row[d]));
            const float c2 = bf16_to_f32(f32_to_bf16(cos_row[d + half]));
            const float s2 = bf16_to_f32(f32_to_bf16(sin_row[d + half]));
            const float a1 = bf16_to_f32(f32_to_bf16(x1 * c1)), b1 = bf16_to_f32(f32_to_bf16(x2 * s1));
            const float a2 = bf16_to_f32(f32_to_bf16(x2 * c2)), b2 = bf16_to_f32(f32_to_bf16(x1 * s2));
            h[d] = f32_to_bf16(a1 - b1);
            h[d + half] = f32_to_bf16(a2 + b2);
        } else {
            float *h = (float *)x + offset;
            const float x1 = h[d], x2 = h[d + half];
            const float a1 = x1 * cos_row[d], b1 = x2 * sin_row[d];
            const float a2 = x2 * cos_row[d + half], b2 = x1 * sin_row[d + half];
            h[d] = a1 - b1;
            h[d + half] = a2 + b2;
        }
    }
}

static inline __attribute__((always_inline)) void rope_rows(void *x, int64_t row_stride, int num_rows, int num_heads,
                                                            int head_dim, const int64_t *positions, const float *cos,
                                                            const float *sin, const int bf16) {
#pragma omp for schedule(static)
    for (int i = 0; i < num_rows * num_heads; i++) {
        const int r = i / num_heads, h = i % num_heads;
        const int64_t p = positions[r] * head_dim;
        rope_row(x, r * row_stride + (int64_t)h * head_dim, head_dim, cos + p, sin + p, bf16);
    }
}

/* ------------------------------------------------------------------ silu(gate) * up */

/* gate_up [rows, 2 * inter] (gate then up) -> out [rows, inter]: silu(g) = g / (1 + exp(-g)),
 * rounded to the dtype, times up, rounded. */
static inline __attribute__((always_inline)) void silu_mul_rows(const void *gate_up, void *out, int num_rows, int inter,
                                                                const int bf16) {
#ifdef VL
    const int chunks = inter / VL;
#pragma omp for schedule(static)
    for (int i = 0; i < num_rows * chunks; i++) {
        const int r = i / chunks, c = (i % chunks) * VL;
        const int64_t g = (int64_t)r * 2 * inter + c;
        const vf gate = vload(gate_up, g, bf16), up = vload(gate_up, g + inter, bf16);
        vf silu = vdiv(gate, vadd(vset1(1.0f), vexp(vsub(vzero(), gate))));
        if (bf16) silu = vround_bf16(silu); /* rounded before the product, as torch's silu then mul_ round */
        vstore(out, (int64_t)r * inter + c, vmul(silu, up), bf16);
    }
    const int done = chunks * VL;
#else
    const int done = 0;
#endif
    if (done == inter) return;
#pragma omp for schedule(static)
    for (int r = 0; r < num_rows; r++) {
        for (int d = done; d < inter; d++) {
            const int64_t g = (int64_t)r * 2 * inter + d;
            const float gate = bf16 ? bf16_to_f32(((const uint16_t *)gate_up)[g]) : ((const float *)gate_up)[g];
            const float up = bf16 ? bf16_to_f32(((const uint16_t *)gate_up)[g + inter]) : ((const float *)gate_up)[g + inter];
#ifdef VL /* the vector path's arithmetic, one lane of it */
            float lanes[VL];
            vstore(lanes, 0, vdiv(vset1(gate), vadd(vset1(1.0f), vexp(vset1(-gate)))), 0);
            float silu = lanes[0];
#else
            float silu = gate / (1.0f + expf(-gate));
#endif
            if (bf16) {
                silu = bf16_to_f32(f32_to_bf16(silu));
                ((uint16_t *)out)[(int64_t)r * inter + d] = f32_to_bf16(silu * up);
            } else {
                ((float *)out)[(int64_t)r * inter + d] = silu * up;
            }
        }
    }
}

/* The per-operator path's entry points (a parallel region only where there is work to share). */
void rope_f32(float *x, int64_t row_stride, int num_rows, int num_heads, int head_dim, const int64_t *positions,
              const float *cos, const float *sin, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (num_rows >= 16)
    rope_rows(x, row_stride, num_rows, num_heads, head_dim, positions, cos, sin, 0);
}

void rope_bf16(uint16_t *x, int64_t row_stride, int num_rows, int num_heads, int head_dim, const int64_t *positions,
               const float *cos, const float *sin, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (num_rows >= 16)
    rope_rows(x, row_stride, num_rows, num_heads, head_dim, positions, cos, sin, 1);
}

void silu_mul_f32(const float *gate_up, float *out, int num_rows, int inter, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (num_rows >= 4)
    silu_mul_rows(gate_up, out, num_rows, inter, 0);
}

void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int num_rows, int inter, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (num_rows >= 4)
    silu_mul_rows(gate_up, out, num_rows, inter, 1);
}

/* ------------------------------------------------------------------ the stack */

/* Per layer, the addresses of its tensors, in this order (int64 each; 0 for an absent bias); each
 * linear's _FORMAT: 0 where its weight is packed for linear.c, else it is kept quantized
 * (linear_q.c's records, in the format this word says). */
enum {
    INPUT_NORM, QKV, QKV_BIAS, QKV_FORMAT, O, O_BIAS, O_FORMAT, POST_NORM, GATE_UP, GATE_UP_BIAS, GATE_UP_FORMAT, DOWN,
    DOWN_BIAS, DOWN_FORMAT, KEY_CACHE, VALUE_CACHE, Q_NORM, K_NORM, LAYER_FIELDS  /* Q_NORM, K_NORM: 0 if none */
};

#define P(l, f) ((const void *)(intptr_t)layers[(int64_t)(l) * LAYER_FIELDS + (f)])
#define FORMAT(l, f) (layers[(int64_t)(l) * LAYER_FIELDS + (f)])

static inline __attribute__((always_inline)) void linear_any(const void *x, const void *packed, const void *bias,
                                                             int64_t format, void *scratch, void *y, int rows, int out,
                                                             int in, const int bf16) {
    if (format)
        linear_q_rows(x, in, packed, bias, y, rows, out, in, (int)format, scratch, bf16);
    else if (bf16)
        linear_tiles_bf16(x, in, packed, bias, y, rows, out, in);
    else
        linear_tiles_f32(x, in, packed, bias, y, rows, out, in);
}

static inline __attribute__((always_inline)) void norm_any(const void *x, void *residual, const void *weight, void *out,
                                                           int rows, int dim, float eps, const int bf16) {
    if (bf16)
        rms_norm_rows_bf16(x, dim, residual, weight, out, rows, dim, eps);
    else
        rms_norm_rows_f32(x, dim, residual, weight, out, rows, dim, eps);
}

/* Qwen3: every query head of every row normalised by q_norm, every key head by k_norm (head_dim
 * weights each), in place in the rows of q, k, v; as the per-operator path's rms_norm does it. */
static inline __attribute__((always_inline)) void norm_heads(void *qkv, int qkv_size, int rows, int num_heads,
                                                             int kv_heads, int head_dim, const void *q_norm,
                                                             const void *k_norm, float eps, const int bf16) {
    const int heads = num_heads + kv_heads;
#pragma omp for schedule(static)
    for (int i = 0; i < rows * heads; i++) {
        const int h = i % heads;
        const int64_t o = (int64_t)(i / heads) * qkv_size + (int64_t)h * head_dim;
        float row[head_dim];
        for (int d = 0; d < head_dim; d++)
            row[d] = bf16 ? bf16_to_f32(((const uint16_t *)qkv)[o + d]) : ((const float *)qkv)[o + d];
        norm_vector(row, h < num_heads ? q_norm : k_norm, qkv, o, head_dim, eps, bf16);
    }
}

static inline __attribute__((always_inline)) void decode_layers(
        void *x, void *residual, void *h, void *qkv, void *attn, void *gate_up, void *act, void *scratch,
        const int64_t *layers,
        int num_layers, const int64_t *slots, const int64_t *positions, const float *cos, const float *sin,
        const int32_t *block_table, int max_blocks, const int32_t *context_lens, const int32_t *first_positions,
        int rows, int hidden, int num_heads, int kv_heads, int head_dim, int inter, int block_size, float eps,
        float scale, int num_threads, const int bf16, int kv16) {
    const int esize = bf16 ? 2 : 4, cache_size = kv16 ? 2 : 4;
    const int q_size = num_heads * head_dim, kv_size = kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
#pragma omp parallel num_threads(num_threads)
    for (int l = 0; l < num_layers; l++) {
        if (l == 0) {
            norm_any(x, 0, P(l, INPUT_NORM), h, rows, hidden, eps, bf16);
#pragma omp single
            memcpy(residual, x, (size_t)rows * hidden * esize);
        } else {
            norm_any(x, residual, P(l, INPUT_NORM), h, rows, hidden, eps, bf16);
        }
        linear_any(h, P(l, QKV), P(l, QKV_BIAS), FORMAT(l, QKV_FORMAT), scratch, qkv, rows, qkv_size, hidden, bf16);
        if (P(l, Q_NORM))
            norm_heads(qkv, qkv_size, rows, num_heads, kv_heads, head_dim, P(l, Q_NORM), P(l, K_NORM), eps, bf16);
        rope_rows(qkv, qkv_size, rows, num_heads + kv_heads, head_dim, positions, cos, sin, bf16);
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) { /* the new key and value into the row's cache slot, in the cache's layout */
            const char *row = (const char *)qkv + (int64_t)r * qkv_size * esize;
            store_kv(row + (int64_t)q_size * esize, row + (int64_t)(q_size + kv_size) * esize, (void *)P(l, KEY_CACHE),
                     (void *)P(l, VALUE_CACHE), slots[r], kv_heads, head_dim, block_size, esize, cache_size);
        }
        if (bf16)
            paged_decode_rows_bf16(qkv, qkv_size, P(l, KEY_CACHE), P(l, VALUE_CACHE), block_table, max_blocks,
                                   context_lens, first_positions, attn, rows, num_heads, kv_heads, head_dim,
                                   block_size, scale);
        else
            paged_decode_rows_f32(qkv, qkv_size, P(l, KEY_CACHE), P(l, VALUE_CACHE), block_table, max_blocks,
                                  context_lens, first_positions, attn, rows, num_heads, kv_heads, head_dim,
                                  block_size, scale, kv16);
        linear_any(attn, P(l, O), P(l, O_BIAS), FORMAT(l, O_FORMAT), scratch, x, rows, hidden, q_size, bf16);
        norm_any(x, residual, P(l, POST_NORM), h, rows, hidden, eps, bf16);
        linear_any(h, P(l, GATE_UP), P(l, GATE_UP_BIAS), FORMAT(l, GATE_UP_FORMAT), scratch, gate_up, rows, 2 * inter, hidden, bf16);
        silu_mul_rows(gate_up, act, rows, inter, bf16);
        linear_any(act, P(l, DOWN), P(l, DOWN_BIAS), FORMAT(l, DOWN_FORMAT), scratch, x, rows, hidden, inter, bf16);
    }
}

/* x [rows, hidden]: the embeddings in, the last layer's output out (not yet added to the residual
 * stream, which is left in residual [rows, hidden]); h, qkv, attn, gate_up, act: scratch rows of
 * hidden, q + 2 kv, q, 2 inter and inter values; scratch: the quantized linears' int8 activations
 * (linear_q_rows' size for the widest input; unused without them). slots, positions [rows]; the attention metadata
 * as paged_decode takes it. All float32, or all bfloat16 (the tables stay float32); the float32
 * stack's KV cache is bfloat16 where kv16 is 1 (--kv-cache-dtype bfloat16). */
void decode_layers_f32(float *x, float *residual, float *h, float *qkv, float *attn, float *gate_up, float *act,
                       void *scratch, const int64_t *layers, int num_layers, const int64_t *slots, const int64_t *positions,
                       const float *cos, const float *sin, const int32_t *block_table, int max_blocks,
                       const int32_t *context_lens, const int32_t *first_positions, int rows, int hidden,
                       int num_heads, int kv_heads, int head_dim, int inter, int block_size, float eps, float scale,
                       int num_threads, int kv16) {
    decode_layers(x, residual, h, qkv, attn, gate_up, act, scratch, layers, num_layers, slots, positions, cos, sin,
                  block_table, max_blocks, context_lens, first_positions, rows, hidden, num_heads, kv_heads,
                  head_dim, inter, block_size, eps, scale, num_threads, 0, kv16);
}

void decode_layers_bf16(uint16_t *x, uint16_t *residual, uint16_t *h, uint16_t *qkv, uint16_t *attn,
                        uint16_t *gate_up, uint16_t *act, void *scratch, const int64_t *layers, int num_layers, const int64_t *slots,
                        const int64_t *positions, const float *cos, const float *sin, const int32_t *block_table,
                        int max_blocks, const int32_t *context_lens, const int32_t *first_positions, int rows,
                        int hidden, int num_heads, int kv_heads, int head_dim, int inter, int block_size, float eps,
                        float scale, int num_threads) {
    decode_layers(x, residual, h, qkv, attn, gate_up, act, scratch, layers, num_layers, slots, positions, cos, sin,
                  block_table, max_blocks, context_lens, first_positions, rows, hidden, num_heads, kv_heads,
                  head_dim, inter, block_size, eps, scale, num_threads, 1, 1);
}
