/* y = x W^T (+ bias) with W kept quantized, as GGUF files store it, on CPUs with AVX-512 VNNI.
 *
 * GGUF's block formats all say the same thing in different bit layouts: a row is cut into blocks
 * of 32 inputs, and weight j of a block is  scale * code_j + min  with small unsigned integer
 * codes (Q4_0: min = -8 scale; Q4_1: its own min; Q8_0: codes q + 128, min = -128 scale; the
 * K-quants Q4_K and Q5_K: each 32-input sub-block's scale and min are the super-block's fp16
 * factors times its 6-bit integers). worker/kernels/quantized.py turns a file's blocks into that
 * one form, exactly, and packs it for this kernel, per 16 outputs and 32 inputs:
 *
 *     codes   4-bit: 4 x 64 bytes, byte 4 o + i of vector v = code of input 4 v + i (low nibble)
 *                    and of input 4 (v + 4) + i (high nibble), for output o < 16
 *             8-bit: 8 x 64 bytes, byte 4 o + i of vector g = code of input 4 g + i
 *     scales  16 float32, mins 16 float32
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

static inline int64_t record_bytes(int bits) { return (bits == 4 ? 4 : 8) * 64 + 2 * 64; }

/* ------------------------------------------------------------------ activations */

/* x [rows, in] (rows x_stride apart) -> codes [rows, in] int8, dx [rows, in / 32], s [rows, in / 32]. */
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
        int sum = 0;
        int8_t *q = codes + (int64_t)r * in + (int64_t)k * QBLOCK;
        for (int j = 0; j < QBLOCK; j++) {
            const int c = (int)nearbyintf(v[j] * inv);
            q[j] = (int8_t)c;
            sum += c;
        }
        dx[(int64_t)r * blocks + k] = d;
        s[(int64_t)r * blocks + k] = d * (float)sum;
    }
}

/* ------------------------------------------------------------------ the product */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "simd.h"

static inline void store_out(void *y, int o, int out, __m512 v, const int bf16) {
    if (o >= out) return;
    const __mmask16 lanes = out - o >= 16 ? 0xFFFF : (__mmask16)((1u << (out - o)) - 1);
    if (bf16)
        _mm256_mask_storeu_epi16((uint16_t *)y + o, lanes, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(v), 16)));
    else
        _mm512_mask_storeu_ps((float *)y + o, lanes, v);
}

/* Rows r0 .. r0 + rows - 1 by the 16 outputs of block ob; rows, bits and bf16 constants where inlined. */
static inline __attribute__((always_inline)) void qblock(const int8_t *codes, const float *dx, const float *s,
                                                         const uint8_t *packed, const void *bias, void *y, int r0,
                                                         const int rows, int ob, int out, int in, const int bits,
                                                         const int bf16) {
    const int blocks = in / QBLOCK;
    const int64_t rec = record_bytes(bits), code_bytes = rec - 128;
    const uint8_t *w = packed + (int64_t)ob * blocks * rec;
    __m512 acc[QROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int k = 0; k < blocks; k++, w += rec) {
        __m512i wg[8];
        if (bits == 4) {
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
        for (int r = 0; r < rows; r++) {
            const int64_t row = r0 + r;
            const int8_t *q = codes + row * in + (int64_t)k * QBLOCK;
            int32_t group[8];
            memcpy(group, q, sizeof group);
            __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512(); /* two chains, half the latency */
            for (int g = 0; g < 8; g += 2) {
                even = _mm512_dpbusd_epi32(even, wg[g], _mm512_set1_epi32(group[g]));
                odd = _mm512_dpbusd_epi32(odd, wg[g + 1], _mm512_set1_epi32(group[g + 1]));
            }
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(dx[row * blocks + k])), acc[r]);
            acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(s[row * blocks + k]), acc[r]);
        }
    }
    const int o = ob * 16;
    __m512 b = _mm512_setzero_ps();
    if (bias != 0 && o < out) {
        const __mmask16 lanes = out - o >= 16 ? 0xFFFF : (__mmask16)((1u << (out - o)) - 1);
        if (bf16)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, (const uint16_t *)bias + o)), 16));
        else
            b = _mm512_maskz_loadu_ps(lanes, (const float *)bias + o);
    }
    for (int r = 0; r < rows; r++)
        store_out((char *)y + (int64_t)(r0 + r) * out * (bf16 ? 2 : 4), o, out, _mm512_add_ps(acc[r], b), bf16);
}

static inline __attribute__((always_inline)) void qblocks_rows(const int8_t *codes, const float *dx, const float *s,
                                                               const uint8_t *packed, const void *bias, void *y,
                                                               int num_rows, int out, int in, const int bits,
                                                               const int bf16) {
    const int out_blocks = (out + 15) / 16;
#pragma omp for schedule(static)
    for (int ob = 0; ob < out_blocks; ob++) {
        int r0 = 0;
        for (; r0 + QROWS <= num_rows; r0 += QROWS) qblock(codes, dx, s, packed, bias, y, r0, QROWS, ob, out, in, bits, bf16);
        switch (num_rows - r0) { /* the last few rows, each count compiled with its own constant */
            case 7: qblock(codes, dx, s, packed, bias, y, r0, 7, ob, out, in, bits, bf16); break;
            case 6: qblock(codes, dx, s, packed, bias, y, r0, 6, ob, out, in, bits, bf16); break;
            case 5: qblock(codes, dx, s, packed, bias, y, r0, 5, ob, out, in, bits, bf16); break;
            case 4: qblock(codes, dx, s, packed, bias, y, r0, 4, ob, out, in, bits, bf16); break;
            case 3: qblock(codes, dx, s, packed, bias, y, r0, 3, ob, out, in, bits, bf16); break;
            case 2: qblock(codes, dx, s, packed, bias, y, r0, 2, ob, out, in, bits, bf16); break;
            case 1: qblock(codes, dx, s, packed, bias, y, r0, 1, ob, out, in, bits, bf16); break;
            default: break;
        }
    }
}
#endif

/* The work-sharing body (as linear.c's, for decoder.c): quantize x into the scratch, a barrier,
 * then the 16-output blocks split among the threads. scratch: rows * (in + 8 * in / 32) bytes. */
void linear_q_rows(const void *x, int64_t x_stride, const uint8_t *packed, const void *bias, void *y, int num_rows,
                   int out, int in, int bits, void *scratch, int bf16) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    int8_t *codes = scratch;
    float *dx = (float *)(codes + (int64_t)num_rows * in), *s = dx + (int64_t)num_rows * (in / QBLOCK);
    if (bf16)
        quantize_rows(x, x_stride, codes, dx, s, num_rows, in, 1);
    else
        quantize_rows(x, x_stride, codes, dx, s, num_rows, in, 0);
    /* the implicit barrier of quantize_rows' omp for: every row's codes are written */
    if (bits == 4 && bf16) qblocks_rows(codes, dx, s, packed, bias, y, num_rows, out, in, 4, 1);
    else if (bits == 4) qblocks_rows(codes, dx, s, packed, bias, y, num_rows, out, in, 4, 0);
    else if (bf16) qblocks_rows(codes, dx, s, packed, bias, y, num_rows, out, in, 8, 1);
    else qblocks_rows(codes, dx, s, packed, bias, y, num_rows, out, in, 8, 0);
#endif
}

/* x [num_rows, in] float32 or bfloat16 (bf16 says which; y the same), in a multiple of 32;
 * packed as above with bits 4 or 8; bias [out] or NULL. A no-op where linear_q_available() is 0. */
void linear_q(const void *x, int64_t x_stride, const uint8_t *packed, const void *bias, void *y, int num_rows, int out,
              int in, int bits, void *scratch, int bf16, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    linear_q_rows(x, x_stride, packed, bias, y, num_rows, out, in, bits, scratch, bf16);
}

int linear_q_available(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0; /* quantized files are served dequantized */
#endif
}
