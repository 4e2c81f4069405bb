/* y = x W^T (+ bias) with W kept quantized, as GGUF files store it, on CPUs with AVX-512 VNNI.
 *
 * GGUF's block formats all say the same thing in different bit layouts: a row is cut into groups
 * of 32 (or 16) inputs, and weight j of a group is  scale * code_j + min  with small unsigned
 * integer codes (Q4_0: min = -8 scale; Q4_1: its own min; Q8_0: codes q + 128, min = -128 scale;
 * the K-quants Q4_K and Q5_K: each 32-input sub-block's scale and min are the super-block's fp16
 * factors times its 6-bit integers; Q6_K: 16-input sub-blocks, scale = d times an int8, min =
 * -32 scale). worker/gguf/quants.py reads a file's blocks into that one form, exactly, and
 * worker/kernels/cpu.py packs it for this kernel, per 16 outputs and 32 inputs (a block):
 *
 *     codes   layout 4:      4 x 64 bytes, byte 4 o + i of vector v = code of input 4 v + i (low
 *                            nibble) and of input 4 (v + 4) + i (high nibble), for output o < 16
 *             layouts 8, 16: 8 x 64 bytes, byte 4 o + i of vector g = code of input 4 g + i
 *     then    layouts 4, 8:  16 float32 scales, 16 float32 mins (one group of 32 inputs)
 *             layout 16:     scales and mins of inputs 0-15, then of inputs 16-31
 *
 * records ordered by 16-output block, then input block. The activations are quantized per row
 * and 32-input block to int8 (x ~ dx q, dx = max |x| / 127; s = dx * sum q), as llama.cpp does
 * for its quantized dot products, and a block's contribution to output o is
 *
 *     sum_j (scale_o c_j + min_o) dx q_j = scale_o dx (sum_j c_j q_j) + min_o s
 *
 * the integer sum by eight vpdpbusd (64 unsigned-by-signed byte products each), the rest two
 * fused multiply-adds on 16 outputs. Every output sums its blocks in the same order whatever the
 * number of rows and wherever its row sits: a row's result does not depend on its batch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define QBLOCK 32   /* inputs per block */
#define QROWS 8     /* rows per pass: 8 accumulators + 8 weight vectors + scale, min stay in registers */

static inline int64_t record_bytes(int layout) { return (layout == 4 ? 4 : 8) * 64 + (layout == 16 ? 4 : 2) * 64; }

/* ------------------------------------------------------------------ activations */

/* x [rows, in] (rows x_stride apart) -> codes [rows, in] int8, dx [rows, in / 32] and s [rows, in / 32, 3]:
 * dx times the sum of the codes of the block, of its first 16 and of its last 16. */
static inline __attribute__((always_inline)) void quantize_rows(const void *x, int64_t x_stride, int8_t *codes,
                                                                float *dx, float *s, int num_rows, int in,
                                                                const int bf16) {
    const int blocks = in / QBLOCK;
#pragma omp for schedule(static)
    for (int i = 0; i < num_rows * blocks; i++) {
        const int r = i / blocks, k = i % blocks;
        float v[QBLOCK], amax = 0.0f;
        for (int j = 0; j < QBLOCK; j++) {
            const int64_t at = (int64_t)r * x_stride + (int64_t)k * QBLOCK + j;
            v[j] = bf16 ? bf16_to_f32(((const uint16_t *)x)[at]) : ((const float *)x)[at];
            amax = fmaxf(amax, fabsf(v[j]));
        }
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t *q = codes + (int64_t)r * in + (int64_t)k * QBLOCK;
        for (int j = 0; j < QBLOCK; j++) q[j] = (int8_t)(int)nearbyintf(v[j] * inv);
        int first = 0, second = 0; /* two plain reductions: they vectorise */
        for (int j = 0; j < QBLOCK / 2; j++) first += q[j];
        for (int j = QBLOCK / 2; j < QBLOCK; j++) second += q[j];
        dx[(int64_t)r * blocks + k] = d;
        float *sums = s + ((int64_t)r * blocks + k) * 3;
        sums[0] = d * (float)(first + second);
        sums[1] = d * (float)first;
        sums[2] = d * (float)second;
    }
}

/* ------------------------------------------------------------------ the product */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "simd.h"

/* Rows r0 .. r0 + rows - 1 by the 16 outputs of block ob; rows, layout and bf16 constants where inlined. */
static inline __attribute__((always_inline)) void qblock(const int8_t *codes, const float *dx, const float *s,
                                                         const uint8_t *packed, const void *bias, void *y, int r0,
                                                         const int rows, int ob, int out, int in, const int layout,
                                                         const int bf16) {
    const int blocks = in / QBLOCK;
    const int64_t rec = record_bytes(layout), code_bytes = (layout == 4 ? 4 : 8) * 64;
    const uint8_t *w = packed + (int64_t)ob * blocks * rec;
    __m512 acc[QROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int k = 0; k < blocks; k++, w += rec) {
        __m512i wg[8];
        if (layout == 4) {
            const __m512i low = _mm512_set1_epi8(0x0F);
            for (int v = 0; v < 4; v++) {
                const __m512i c = _mm512_loadu_si512(w + 64 * v);
                wg[v] = _mm512_and_si512(c, low);
                wg[v + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
            }
        } else {
            for (int g = 0; g < 8; g++) wg[g] = _mm512_loadu_si512(w + 64 * g);
        }
        const __m512 scale = _mm512_loadu_ps(w + code_bytes), min = _mm512_loadu_ps(w + code_bytes + 64);
        const __m512 scale_hi = layout == 16 ? _mm512_loadu_ps(w + code_bytes + 128) : scale;
        const __m512 min_hi = layout == 16 ? _mm512_loadu_ps(w + code_bytes + 192) : min;
        for (int r = 0; r < rows; r++) {
            const int64_t row = r0 + r;
            const int8_t *q = codes + row * in + (int64_t)k * QBLOCK;
            int32_t group[8];
            memcpy(group, q, sizeof group);
            /* two chains, half the latency: inputs 0-15 and 16-31 where layout 16 scales them
             * apart, else alternate groups (as the 4-bit vectors unpack) */
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            for (int g = 0; g < 4; g++) {
                const int a = layout == 16 ? g : 2 * g, b = layout == 16 ? g + 4 : 2 * g + 1;
                lo = _mm512_dpbusd_epi32(lo, wg[a], _mm512_set1_epi32(group[a]));
                hi = _mm512_dpbusd_epi32(hi, wg[b], _mm512_set1_epi32(group[b]));
            }
            const __m512 d = _mm512_set1_ps(dx[row * blocks + k]);
            const float *sums = s + (row * blocks + k) * 3;
            if (layout == 16) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(scale, d), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(scale_hi, d), acc[r]);
                acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(sums[1]), acc[r]);
                acc[r] = _mm512_fmadd_ps(min_hi, _mm512_set1_ps(sums[2]), acc[r]);
            } else {
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi));
                acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, d), acc[r]);
                acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(sums[0]), acc[r]);
            }
        }
    }
    const int o = ob * 16;
    const __m512 b = load_partial16(bias, o, out, bf16);
    for (int r = 0; r < rows; r++)
        store_partial16((char *)y + (int64_t)(r0 + r) * out * (bf16 ? 2 : 4), o, out, _mm512_add_ps(acc[r], b), bf16);
}

static inline __attribute__((always_inline)) void qblocks_rows(const int8_t *codes, const float *dx, const float *s,
                                                               const uint8_t *packed, const void *bias, void *y,
                                                               int num_rows, int out, int in, const int layout,
                                                               const int bf16) {
    const int out_blocks = (out + 15) / 16;
#pragma omp for schedule(static)
    for (int ob = 0; ob < out_blocks; ob++) {
        int r0 = 0;
        for (; r0 + QROWS <= num_rows; r0 += QROWS) qblock(codes, dx, s, packed, bias, y, r0, QROWS, ob, out, in, layout, bf16);
        switch (num_rows - r0) { /* the last few rows, each count compiled with its own constant */
            case 7: qblock(codes, dx, s, packed, bias, y, r0, 7, ob, out, in, layout, bf16); break;
            case 6: qblock(codes, dx, s, packed, bias, y, r0, 6, ob, out, in, layout, bf16); break;
            case 5: qblock(codes, dx, s, packed, bias, y, r0, 5, ob, out, in, layout, bf16); break;
            case 4: qblock(codes, dx, s, packed, bias, y, r0, 4, ob, out, in, layout, bf16); break;
            case 3: qblock(codes, dx, s, packed, bias, y, r0, 3, ob, out, in, layout, bf16); break;
            case 2: qblock(codes, dx, s, packed, bias, y, r0, 2, ob, out, in, layout, bf16); break;
            case 1: qblock(codes, dx, s, packed, bias, y, r0, 1, ob, out, in, layout, bf16); break;
            default: break;
        }
    }
}
#endif

/* The work-sharing body (as linear.c's, for decoder.c): quantize x into the scratch, a barrier,
 * then the 16-output blocks split among the threads. scratch: rows * (in + 16 * in / 32) bytes. */
void linear_q_rows(const void *x, int64_t x_stride, const uint8_t *packed, const void *bias, void *y, int num_rows,
                   int out, int in, int layout, void *scratch, int bf16) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    int8_t *codes = scratch;
    float *dx = (float *)(codes + (int64_t)num_rows * in), *s = dx + (int64_t)num_rows * (in / QBLOCK);
    if (bf16)
        quantize_rows(x, x_stride, codes, dx, s, num_rows, in, 1);
    else
        quantize_rows(x, x_stride, codes, dx, s, num_rows, in, 0);
    /* the implicit barrier of quantize_rows' omp for: every row's codes are written */
    switch (layout * 2 + (bf16 != 0)) { /* each combination compiled with its constants */
        case 8: qblocks_rows(codes, dx, s, packed, bias, y, num_rows, out, in, 4, 0); break;
        case 9: qblocks_rows(codes, dx, s, packed, bias, y, num_rows, out, in, 4, 1); break;
        case 16: qblocks_rows(codes, dx, s, packed, bias, y, num_rows, out, in, 8, 0); break;
        case 17: qblocks_rows(codes, dx, s, packed, bias, y, num_rows, out, in, 8, 1); break;
        case 32: qblocks_rows(codes, dx, s, packed, bias, y, num_rows, out, in, 16, 0); break;
        case 33: qblocks_rows(codes, dx, s, packed, bias, y, num_rows, out, in, 16, 1); break;
        default: break;
    }
#endif
}

/* x [num_rows, in] float32 or bfloat16 (bf16 says which; y the same), in a multiple of 32;
 * packed as above in layout 4, 8 or 16; bias [out] or NULL. A no-op where linear_q_available() is 0. */
void linear_q(const void *x, int64_t x_stride, const uint8_t *packed, const void *bias, void *y, int num_rows, int out,
              int in, int layout, void *scratch, int bf16, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    linear_q_rows(x, x_stride, packed, bias, y, num_rows, out, in, layout, scratch, bf16);
}

int linear_q_available(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0; /* quantized files are served dequantized */
#endif
}
