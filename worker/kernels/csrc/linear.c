/* y = x W^T (+ bias) on CPUs with AVX-512, in float32 (fused multiply-adds) or in bfloat16 (with
 * AVX512-BF16: products of bfloat16 pairs summed in float32 by vdpbf16ps, one rounding to
 * bfloat16 at the end, as oneDNN and torch round).
 *
 * The weight is packed once (worker/kernels/cpu.py: pack_linear) so that a load of 64 bytes is
 * 16 consecutive outputs times 1 input (float32) or times 2 consecutive inputs (bfloat16):
 *
 *     float32:  packed[ob][i][j]     = W[16 * ob + j][i]
 *     bfloat16: packed[ob][ip][j][t] = W[16 * ob + j][2 * ip + t]      (out padded to a multiple of 64)
 *
 * The inner loop then needs no horizontal sums: for each input (pair), every row of x broadcasts
 * it to all 16 lanes and meets TILE_BLOCKS weight registers, so a tile of up to MAX_ROWS rows by
 * 64 outputs keeps its accumulators in registers and streams its weights exactly once. Every
 * output sums its inputs in the same order whatever the number of rows and wherever its row sits
 * in a tile: a row's result does not depend on the batch it came in.
 *
 * Measured on a Zen 5 (2 threads), the 121 bfloat16 products of one SmolLM2 decode step at one
 * row read their 269 MB of weights at ~76 GB/s, where oneDNN's packed path reached ~40 GB/s in
 * the model. Threads split the output tiles; for many rows each tile walks the rows MAX_ROWS at a
 * time while its weights stay in cache.
 */
#include <stdint.h>

#ifdef __AVX512F__
#include "simd.h"

#define TILE_BLOCKS 4 /* 16-output blocks per tile: 64 outputs */
#define MAX_ROWS 6    /* rows per tile: 6 x 4 accumulators + 4 weights + 1 broadcast <= 32 registers */

/* One tile: rows r0 .. r0 + rows - 1 by the 64 outputs of tile t; rows and bf16 are constants
 * where inlined, so each combination compiles to its own register-resident loop. */
static inline __attribute__((always_inline)) void tile(const void *x, int64_t x_stride, const void *packed,
                                                       const void *bias, void *y, int r0, const int rows, int t,
                                                       int out, int in, const int bf16) {
    __m512 acc[MAX_ROWS][TILE_BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < TILE_BLOCKS; b++) acc[r][b] = _mm512_setzero_ps();
    const int steps = bf16 ? in / 2 : in;                  /* 64-byte weight loads per block */
    const char *w = (const char *)packed + (int64_t)t * TILE_BLOCKS * steps * 64;
    for (int s = 0; s < steps; s++) {
        __m512 wv[TILE_BLOCKS];
        for (int b = 0; b < TILE_BLOCKS; b++) wv[b] = _mm512_loadu_ps(w + ((int64_t)b * steps + s) * 64);
        for (int r = 0; r < rows; r++) {
            if (bf16) {
#ifdef __AVX512BF16__
                int32_t pair;
                __builtin_memcpy(&pair, (const uint16_t *)x + (int64_t)(r0 + r) * x_stride + 2 * s, sizeof pair);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                for (int b = 0; b < TILE_BLOCKS; b++)
                    acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)_mm512_castps_si512(wv[b]), xv);
#endif
            } else {
                const __m512 xv = _mm512_set1_ps(((const float *)x)[(int64_t)(r0 + r) * x_stride + s]);
                for (int b = 0; b < TILE_BLOCKS; b++) acc[r][b] = _mm512_fmadd_ps(wv[b], xv, acc[r][b]);
            }
        }
    }
    for (int b = 0; b < TILE_BLOCKS; b++) {
        const int o = (t * TILE_BLOCKS + b) * 16;
        const __m512 bv = load_partial16(bias, o, out, bf16);
        for (int r = 0; r < rows; r++)
            store_partial16((char *)y + (int64_t)(r0 + r) * out * (bf16 ? 2 : 4), o, out, _mm512_add_ps(acc[r][b], bv), bf16);
    }
}

static inline __attribute__((always_inline)) void linear_tiles(const void *x, int64_t x_stride, const void *packed,
                                                               const void *bias, void *y, int num_rows, int out, int in,
                                                               const int bf16) {
    const int tiles = (out + 16 * TILE_BLOCKS - 1) / (16 * TILE_BLOCKS);
#pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        int r0 = 0;
        for (; r0 + MAX_ROWS <= num_rows; r0 += MAX_ROWS) tile(x, x_stride, packed, bias, y, r0, MAX_ROWS, t, out, in, bf16);
        switch (num_rows - r0) { /* the last few rows, each count compiled with its own constant */
            case 5: tile(x, x_stride, packed, bias, y, r0, 5, t, out, in, bf16); break;
            case 4: tile(x, x_stride, packed, bias, y, r0, 4, t, out, in, bf16); break;
            case 3: tile(x, x_stride, packed, bias, y, r0, 3, t, out, in, bf16); break;
            case 2: tile(x, x_stride, packed, bias, y, r0, 2, t, out, in, bf16); break;
            case 1: tile(x, x_stride, packed, bias, y, r0, 1, t, out, in, bf16); break;
            default: break;
        }
    }
}
#endif

/* The work-sharing bodies (tiles split among the threads of the enclosing parallel region, as in
 * decoder.c's layer loop; all of them by one thread outside one). */
void linear_tiles_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y,
                      int num_rows, int out, int in) {
#ifdef __AVX512F__
    linear_tiles(x, x_stride, packed, bias, y, num_rows, out, in, 0);
#endif
}

void linear_tiles_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                       int num_rows, int out, int in) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    linear_tiles(x, x_stride, packed, bias, y, num_rows, out, in, 1);
#endif
}

/* x [num_rows, in] (rows x_stride elements apart; in even for bfloat16), packed as above, bias
 * [out] or NULL, y [num_rows, out] contiguous. Each is a no-op where *_available() says 0. */
void linear_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y, int num_rows,
                int out, int in, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (out > 16 * 4)
    linear_tiles_f32(x, x_stride, packed, bias, y, num_rows, out, in);
}

void linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                 int num_rows, int out, int in, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (out > 16 * 4)
    linear_tiles_bf16(x, x_stride, packed, bias, y, num_rows, out, in);
}

int linear_f32_available(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0; /* MKL's path is used */
#endif
}

int linear_bf16_available(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0; /* oneDNN's path is used */
#endif
}
