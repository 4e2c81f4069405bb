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
 * it to all lanes and meets the pass's weight registers, so a pass of up to MAX_ROWS rows by up
 * to 64 outputs keeps its accumulators in registers and streams its weights once. Every output sums its inputs in the same order whatever the number of rows and wherever
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
#define TILE_BLOCKS 4        /* 16-output blocks per tile: 64 outputs, the unit the threads share */
#define MAX_ROWS 6           /* rows per pass over a tile's weights */
#define MAX_VECS (TILE_BLOCKS * BLOCK_VECS)
#if VL == 16 && defined(__AVX512BF16__)
#define BF16_DOT 1 /* vdpbf16ps */
#else
#define BF16_DOT 0
#endif

/* One pass: rows r0 .. r0 + rows - 1 by blocks b0 .. b0 + blocks - 1 of tile t; rows, blocks and
 * bf16 are constants where inlined, so each combination compiles to its own register-resident
 * loop. Its rows x blocks accumulators are independent chains of fused multiply-adds, enough of
 * them to hide the FMA's latency even at one row. */
static inline __attribute__((always_inline)) void pass(const void *x, int64_t x_stride, const void *packed,
                                                       const void *bias, void *y, int r0, const int rows, int t,
                                                       int b0, const int blocks, int out, int in, const int bf16) {
    vf acc[MAX_ROWS][MAX_VECS];
    const int vecs = blocks * BLOCK_VECS;
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < vecs; k++) acc[r][k] = vzero();
    const int steps = bf16 ? in / 2 : in; /* 64-byte loads per 16-output block */
    const char *w = (const char *)packed + ((int64_t)t * TILE_BLOCKS + b0) * steps * 64;
    for (int s = 0; s < steps; s++) {
        vf wv[MAX_VECS];
        for (int b = 0; b < blocks; b++)
            for (int h = 0; h < BLOCK_VECS; h++)
                wv[b * BLOCK_VECS + h] = vloadu(w + ((int64_t)b * steps + s) * 64 + h * VL * 4);
        if (!bf16) {
            for (int r = 0; r < rows; r++) {
                const vf xv = vset1(((const float *)x)[(int64_t)(r0 + r) * x_stride + s]);
                for (int k = 0; k < vecs; k++) acc[r][k] = vfma(wv[k], xv, acc[r][k]);
            }
            continue;
        }
        const uint16_t *xs = (const uint16_t *)x + 2 * s;
#if BF16_DOT
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            __builtin_memcpy(&pair, xs + (int64_t)(r0 + r) * x_stride, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int k = 0; k < vecs; k++)
                acc[r][k] = _mm512_dpbf16_ps(acc[r][k], (__m512bh)_mm512_castps_si512(wv[k]), xv);
        }
#else
        vf first[MAX_VECS], second[MAX_VECS];
        for (int k = 0; k < vecs; k++) first[k] = vpair_first(wv[k]), second[k] = vpair_second(wv[k]);
        for (int r = 0; r < rows; r++) {
            const uint16_t *xr = xs + (int64_t)(r0 + r) * x_stride;
            const vf x0 = vset1(bf16_to_f32(xr[0])), x1 = vset1(bf16_to_f32(xr[1]));
            for (int k = 0; k < vecs; k++) acc[r][k] = vfma(second[k], x1, vfma(first[k], x0, acc[r][k]));
        }
#endif
    }
    for (int k = 0; k < vecs; k++) {
        const int o = (t * TILE_BLOCKS + b0) * 16 + k * VL;
        const vf bv = vload_partial(bias, o, out, bf16);
        for (int r = 0; r < rows; r++)
            vstore_partial((char *)y + (int64_t)(r0 + r) * out * (bf16 ? 2 : 4), o, out, vadd(acc[r][k], bv), bf16);
    }
}

/* Rows r0 .. r0 + rows - 1 of tile t, in passes whose accumulators fit the registers: AVX-512's
 * 32 hold 6 rows by the whole tile (24 accumulators, 4 weights, a broadcast); AVX2's 16 hold at
 * most 12 accumulators, so 3 to 6 rows go a block at a time, 2 rows two blocks, 1 row the tile. */
static inline __attribute__((always_inline)) void tile_rows(const void *x, int64_t x_stride, const void *packed,
                                                            const void *bias, void *y, int r0, const int rows, int t,
                                                            int out, int in, const int bf16) {
    const int blocks = VL == 16 || rows == 1 ? TILE_BLOCKS : rows == 2 ? 2 : 1;
    for (int b0 = 0; b0 < TILE_BLOCKS; b0 += blocks) pass(x, x_stride, packed, bias, y, r0, rows, t, b0, blocks, out, in, bf16);
}

static inline __attribute__((always_inline)) void linear_tiles(const void *x, int64_t x_stride, const void *packed,
                                                               const void *bias, void *y, int num_rows, int out, int in,
                                                               const int bf16) {
    const int tiles = (out + 16 * TILE_BLOCKS - 1) / (16 * TILE_BLOCKS);
#pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        int r0 = 0;
        for (; r0 + MAX_ROWS <= num_rows; r0 += MAX_ROWS) tile_rows(x, x_stride, packed, bias, y, r0, MAX_ROWS, t, out, in, bf16);
        switch (num_rows - r0) { /* the last few rows, each count compiled with its own constant */
            case 5: tile_rows(x, x_stride, packed, bias, y, r0, 5, t, out, in, bf16); break;
            case 4: tile_rows(x, x_stride, packed, bias, y, r0, 4, t, out, in, bf16); break;
            case 3: tile_rows(x, x_stride, packed, bias, y, r0, 3, t, out, in, bf16); break;
            case 2: tile_rows(x, x_stride, packed, bias, y, r0, 2, t, out, in, bf16); break;
            case 1: tile_rows(x, x_stride, packed, bias, y, r0, 1, t, out, in, bf16); break;
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
