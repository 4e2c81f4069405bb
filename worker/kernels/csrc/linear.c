/* y = x W^T (+ bias) on CPUs with AVX-512 or AVX2 (with FMA), float32 or bfloat16: fused
 * multiply-adds in float32, one rounding to bfloat16 at the end, as oneDNN and torch round.
 * bfloat16 weights and activations are widened to float32 in registers (a shift), except on CPUs
 * with AVX512-BF16, where vdpbf16ps multiplies the pairs itself.
 *
 * The weight is packed once (worker/kernels/cpu.py: pack_linear) so that a load of 64 bytes is
 * 16 consecutive outputs times 1 input (float32) or times 2 consecutive inputs (bfloat16):
 *
 *     float32:  packed[ob][i][j]     = W[16 * ob + j][i]
 *     bfloat16: packed[ob][ip][j][t] = W[16 * ob + j][2 * ip + t]      (out padded to a multiple of 64)
 *
 * The inner loop then needs no horizontal sums: for each input (pair), every row of x broadcasts
 * it to all lanes and meets the tile's weight registers, so a tile of up to MAX_ROWS rows by
 * TILE_BLOCKS x 16 outputs keeps its accumulators in registers and streams its weights exactly
 * once. Every output sums its inputs in the same order whatever the number of rows and wherever
 * its row sits in a tile: a row's result does not depend on the batch it came in. The same holds
 * across instruction sets: an AVX2 build gives the AVX-512 build's float32 results bit for bit
 * (and its widened bfloat16 ones; vdpbf16ps sums a pair before adding it, so those differ).
 *
 * Measured on a Zen 5 (2 threads), the 121 bfloat16 products of one SmolLM2 decode step at one
 * row read their 269 MB of weights at ~76 GB/s, where oneDNN's packed path reached ~40 GB/s in
 * the model. Threads split the output tiles; for many rows each tile walks the rows MAX_ROWS at a
 * time while its weights stay in cache.
 */
#include <stdint.h>

#include "bf16.h"
#include "simd.h"

#ifdef VL
#define BLOCK_VECS (16 / VL) /* vectors per 16-output block */
#if VL == 16
#define TILE_BLOCKS 4 /* 16-output blocks per tile: 64 outputs */
#define MAX_ROWS 6    /* rows per tile: 6 x 4 accumulators + 4 weights + 1 broadcast <= 32 registers */
#else
#define TILE_BLOCKS 1 /* 16 outputs, two registers */
#define MAX_ROWS 6    /* 6 x 2 accumulators + 2 weights + 1 broadcast <= 16 registers */
#endif
#define TILE_VECS (TILE_BLOCKS * BLOCK_VECS)
#if VL == 16 && defined(__AVX512BF16__)
#define BF16_DOT 1 /* vdpbf16ps */
#else
#define BF16_DOT 0
#endif

/* One tile: rows r0 .. r0 + rows - 1 by the outputs of tile t; rows and bf16 are constants where
 * inlined, so each combination compiles to its own register-resident loop. */
static inline __attribute__((always_inline)) void tile(const void *x, int64_t x_stride, const void *packed,
                                                       const void *bias, void *y, int r0, const int rows, int t,
                                                       int out, int in, const int bf16) {
    vf acc[MAX_ROWS][TILE_VECS];
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < TILE_VECS; k++) acc[r][k] = vzero();
    const int steps = bf16 ? in / 2 : in; /* 64-byte loads per 16-output block */
    const char *w = (const char *)packed + (int64_t)t * TILE_BLOCKS * steps * 64;
    for (int s = 0; s < steps; s++) {
        vf wv[TILE_VECS];
        for (int b = 0; b < TILE_BLOCKS; b++)
            for (int h = 0; h < BLOCK_VECS; h++)
                wv[b * BLOCK_VECS + h] = vloadu(w + ((int64_t)b * steps + s) * 64 + h * VL * 4);
        if (!bf16) {
            for (int r = 0; r < rows; r++) {
                const vf xv = vset1(((const float *)x)[(int64_t)(r0 + r) * x_stride + s]);
                for (int k = 0; k < TILE_VECS; k++) acc[r][k] = vfma(wv[k], xv, acc[r][k]);
            }
            continue;
        }
        const uint16_t *xs = (const uint16_t *)x + 2 * s;
#if BF16_DOT
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            __builtin_memcpy(&pair, xs + (int64_t)(r0 + r) * x_stride, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int k = 0; k < TILE_VECS; k++)
                acc[r][k] = _mm512_dpbf16_ps(acc[r][k], (__m512bh)_mm512_castps_si512(wv[k]), xv);
        }
#else
        vf first[TILE_VECS], second[TILE_VECS];
        for (int k = 0; k < TILE_VECS; k++) first[k] = vpair_first(wv[k]), second[k] = vpair_second(wv[k]);
        for (int r = 0; r < rows; r++) {
            const uint16_t *xr = xs + (int64_t)(r0 + r) * x_stride;
            const vf x0 = vset1(bf16_to_f32(xr[0])), x1 = vset1(bf16_to_f32(xr[1]));
            for (int k = 0; k < TILE_VECS; k++) acc[r][k] = vfma(second[k], x1, vfma(first[k], x0, acc[r][k]));
        }
#endif
    }
    for (int k = 0; k < TILE_VECS; k++) {
        const int o = t * TILE_BLOCKS * 16 + k * VL;
        const vf bv = vload_partial(bias, o, out, bf16);
        for (int r = 0; r < rows; r++)
            vstore_partial((char *)y + (int64_t)(r0 + r) * out * (bf16 ? 2 : 4), o, out, vadd(acc[r][k], bv), bf16);
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
#ifdef VL
    linear_tiles(x, x_stride, packed, bias, y, num_rows, out, in, 0);
#endif
}

void linear_tiles_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                       int num_rows, int out, int in) {
#ifdef VL
    linear_tiles(x, x_stride, packed, bias, y, num_rows, out, in, 1);
#endif
}

/* x [num_rows, in] (rows x_stride elements apart; in even for bfloat16), packed as above, bias
 * [out] or NULL, y [num_rows, out] contiguous. Each is a no-op where linear_available() says 0. */
void linear_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y, int num_rows,
                int out, int in, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (out > 64)
    linear_tiles_f32(x, x_stride, packed, bias, y, num_rows, out, in);
}

void linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                 int num_rows, int out, int in, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (out > 64)
    linear_tiles_bf16(x, x_stride, packed, bias, y, num_rows, out, in);
}

/* Which instructions the kernel multiplies with: 0 none (torch's paths are used), 1 AVX2 and FMA,
 * 2 AVX-512, 3 AVX-512 with AVX512-BF16 (bfloat16 pairs by vdpbf16ps). */
int linear_available(void) {
#if !defined(VL)
    return 0;
#elif BF16_DOT
    return 3;
#elif VL == 16
    return 2;
#else
    return 1;
#endif
}
