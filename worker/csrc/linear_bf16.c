/* y = x W^T (+ bias) in bfloat16 on CPUs with AVX512-BF16: products of bfloat16 pairs summed in
 * float32 by vdpbf16ps, one rounding to bfloat16 at the end (as oneDNN and torch round).
 *
 * The weight is packed once (worker/cpu_kernels.py: pack_linear_bf16) so that a load of 64 bytes
 * is 16 consecutive outputs times 2 consecutive inputs:
 *
 *     packed[ob][ip][j][t] = W[16 * ob + j][2 * ip + t]      (out padded to a multiple of 64)
 *
 * The inner loop then needs no horizontal sums: for each input pair, every row of x broadcasts its
 * pair to all 16 lanes and meets TILE_BLOCKS weight registers, so a tile of ROWS rows by 64
 * outputs keeps ROWS x 4 accumulators in registers and streams its weights exactly once.
 * Measured on a Zen 5 (2 threads), the 121 products of one SmolLM2 decode step at one row read
 * their 269 MB of weights at ~76 GB/s, where oneDNN's packed path reached ~40 GB/s in the model.
 * Threads split the output tiles; for many rows each tile walks the rows ROWS at a time while its
 * weights stay in cache.
 */
#include <stdint.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define TILE_BLOCKS 4 /* 16-output blocks per tile: 64 outputs */
#define MAX_ROWS 6    /* rows per tile: 6 x 4 accumulators + 4 weights + 1 broadcast <= 32 registers */

static inline __m512 bias16(const uint16_t *bias, int o, int out) {
    if (bias == 0) return _mm512_setzero_ps();
    const __mmask16 lanes = out - o >= 16 ? 0xFFFF : (__mmask16)((1u << (out - o)) - 1);
    const __m256i half = _mm256_maskz_loadu_epi16(lanes, bias + o);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

static inline void store_bf16(uint16_t *y, int o, int out, __m512 v) {
    if (o >= out) return;
    const __mmask16 lanes = out - o >= 16 ? 0xFFFF : (__mmask16)((1u << (out - o)) - 1);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    _mm256_mask_storeu_epi16(y + o, lanes, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

/* One tile: rows r0 .. r0 + rows - 1 (rows a constant where inlined) by the 64 outputs of tile t. */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                                                       const uint16_t *bias, uint16_t *y, int64_t y_stride, int r0,
                                                       const int rows, int t, int out, int pairs) {
    __m512 acc[MAX_ROWS][TILE_BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < TILE_BLOCKS; b++) acc[r][b] = _mm512_setzero_ps();
    const uint16_t *w = packed + (int64_t)t * TILE_BLOCKS * pairs * 32;
    const int64_t block_stride = (int64_t)pairs * 32;
    for (int ip = 0; ip < pairs; ip++) {
        __m512bh wv[TILE_BLOCKS];
        for (int b = 0; b < TILE_BLOCKS; b++) wv[b] = (__m512bh)_mm512_loadu_si512(w + b * block_stride + ip * 32);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            __builtin_memcpy(&pair, x + (int64_t)(r0 + r) * x_stride + 2 * ip, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < TILE_BLOCKS; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], wv[b], xv);
        }
    }
    for (int b = 0; b < TILE_BLOCKS; b++) {
        const int o = (t * TILE_BLOCKS + b) * 16;
        const __m512 bv = bias16(bias, o, out);
        for (int r = 0; r < rows; r++) store_bf16(y + (int64_t)(r0 + r) * y_stride, o, out, _mm512_add_ps(acc[r][b], bv));
    }
}

/* x [num_rows, in] (rows x_stride apart, in even), packed as above, bias [out] or NULL,
 * y [num_rows, out] contiguous. */
void linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                 int num_rows, int out, int in, int num_threads) {
    const int pairs = in / 2;
    const int tiles = (out + 16 * TILE_BLOCKS - 1) / (16 * TILE_BLOCKS);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tiles > 1)
    for (int t = 0; t < tiles; t++) {
        int r0 = 0;
        for (; r0 + MAX_ROWS <= num_rows; r0 += MAX_ROWS) tile(x, x_stride, packed, bias, y, out, r0, MAX_ROWS, t, out, pairs);
        switch (num_rows - r0) { /* the last few rows, each count compiled with its own constant */
            case 5: tile(x, x_stride, packed, bias, y, out, r0, 5, t, out, pairs); break;
            case 4: tile(x, x_stride, packed, bias, y, out, r0, 4, t, out, pairs); break;
            case 3: tile(x, x_stride, packed, bias, y, out, r0, 3, t, out, pairs); break;
            case 2: tile(x, x_stride, packed, bias, y, out, r0, 2, t, out, pairs); break;
            case 1: tile(x, x_stride, packed, bias, y, out, r0, 1, t, out, pairs); break;
            default: break;
        }
    }
}

int linear_bf16_available(void) { return 1; }
#else
void linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                 int num_rows, int out, int in, int num_threads) {
    (void)x; (void)x_stride; (void)packed; (void)bias; (void)y; (void)num_rows; (void)out; (void)in;
    (void)num_threads;
}

int linear_bf16_available(void) { return 0; } /* no AVX512-BF16 here: oneDNN's path is used */
#endif
