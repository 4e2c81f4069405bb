/* y = x W^T (+ bias) with W kept quantized, as GGUF files store it, on CPUs with AVX-512 VNNI or AVX2.
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
 *
 * Without AVX-512 VNNI, AVX2 computes the same integer sums (exactly: vpmaddubsw's 16-bit pair
 * sums cannot saturate on codes below 16, and 8-bit codes are split into their two nibbles) and
 * then the same float operations in the same order on two halves of 8 outputs, so its results
 * are the VNNI kernel's bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* The instructions the kernel is built with (linear_q_available says which): 2 AVX-512 VNNI, 1 AVX2, 0 none. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QUANTIZED_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#define QUANTIZED_ISA 1
#else
#define QUANTIZED_ISA 0
#endif

#define QBLOCK 32   /* inputs per block */
#define QROWS 8     /* the most rows a pass takes (qblock's accumulators) */

static inline int64_t record_bytes(int layout) { return (layout == 4 ? 4 : 8) * 64 + (layout == 16 ? 4 : 2) * 64; }

/* ------------------------------------------------------------------ activations */

/* x [rows, in] (rows x_stride apart) -> codes [rows, in] int8, dx [rows, in / 32], s [rows, in / 32, 3]:
 * dx times the sum of the codes of the block, of its first 16 and of its last 16, and those last
 * two sums as integers, sums [rows, in / 32, 2] (the AVX2 path's correction for 8-bit codes). */
static inline __attribute__((always_inline)) void quantize_rows(const void *x, int64_t x_stride, int8_t *codes,
                                                                float *dx, float *s, int32_t *sums_int, int num_rows,
                                                                int in, const int bf16) {
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
        if (QUANTIZED_ISA == 1) { /* only the AVX2 path reads them */
            sums_int[((int64_t)r * blocks + k) * 2] = first;
            sums_int[((int64_t)r * blocks + k) * 2 + 1] = second;
        }
    }
}

/* ------------------------------------------------------------------ the product */

#if QUANTIZED_ISA == 2
#include "simd.h"

#define PASS_ROWS QROWS /* 8 accumulators + 8 weight vectors + scale, min stay in registers */

/* Rows r0 .. r0 + rows - 1 by the 16 outputs of block ob; rows, layout and bf16 constants where inlined. */
static inline __attribute__((always_inline)) void qblock(const int8_t *codes, const float *dx, const float *s,
                                                         const int32_t *sums_int, const uint8_t *packed,
                                                         const void *bias, void *y, int r0, const int rows, int ob,
                                                         int out, int in, const int layout, const int bf16) {
    (void)sums_int; /* vpdpbusd multiplies unsigned bytes by signed ones: no correction */
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

#elif QUANTIZED_ISA == 1
#include <immintrin.h>

#define PASS_ROWS 4 /* 2 accumulators a row, in 16 registers with the weights' loads */

/* One block's codes of 8 outputs, unpacked once for all rows into c[g], group g's 32 bytes.
 * Layouts 8 and 16 (codes up to 255) as the signed c - 128, which vpmaddubsw takes as its
 * magnitude and the activation's sign flipped by the code's: c q = (c - 128) q + 128 q. */
static inline __attribute__((always_inline)) void unpack_codes(const uint8_t *w, int half, const int layout,
                                                               __m256i *c) {
    for (int g = 0; g < 8; g++) {
        if (layout == 4) { /* groups g and g + 4 share a vector: low and high nibbles */
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(w + 64 * (g % 4) + 32 * half));
            c[g] = _mm256_and_si256(g < 4 ? packed : _mm256_srli_epi16(packed, 4), _mm256_set1_epi8(0x0F));
        } else {
            c[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 64 * g + 32 * half)),
                                    _mm256_set1_epi8((char)0x80));
        }
    }
}

/* 8 outputs' integer sums over one block for one row: lo over the groups the VNNI kernel sums in
 * its lo chain, hi over the others (the order is immaterial: integer sums are exact). The 16-bit
 * pair sums of vpmaddubsw cannot saturate: 15 x 127 x 2 for 4-bit codes, 128 x 127 x 2 for the
 * others. first, second: the row's integer sums of the block's first and last 16 activations. */
static inline __attribute__((always_inline)) void block_sums(const __m256i *c, const int8_t *q, int32_t first,
                                                             int32_t second, const int layout, __m256i *lo,
                                                             __m256i *hi) {
    int32_t group[8];
    memcpy(group, q, sizeof group);
    const __m256i ones = _mm256_set1_epi16(1);
    if (layout == 4) { /* each chain's four groups summed in 16 bits (4 x 3,810 < 2^15), widened once */
        __m256i pairs_lo = _mm256_setzero_si256(), pairs_hi = _mm256_setzero_si256();
        for (int g = 0; g < 8; g += 2) {
            pairs_lo = _mm256_add_epi16(pairs_lo, _mm256_maddubs_epi16(c[g], _mm256_set1_epi32(group[g])));
            pairs_hi = _mm256_add_epi16(pairs_hi, _mm256_maddubs_epi16(c[g + 1], _mm256_set1_epi32(group[g + 1])));
        }
        *lo = _mm256_madd_epi16(pairs_lo, ones);
        *hi = _mm256_madd_epi16(pairs_hi, ones);
        return;
    }
    *lo = _mm256_setzero_si256();
    *hi = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) {
        const __m256i acts = _mm256_set1_epi32(group[g]);
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c[g]), _mm256_sign_epi8(acts, c[g])),
                                              ones);
        const int in_lo = layout == 16 ? g < 4 : g % 2 == 0;
        if (in_lo) *lo = _mm256_add_epi32(*lo, dot);
        else *hi = _mm256_add_epi32(*hi, dot);
    }
    if (layout == 16) { /* lo: inputs 0-15, hi: 16-31 */
        *lo = _mm256_add_epi32(*lo, _mm256_set1_epi32(128 * first));
        *hi = _mm256_add_epi32(*hi, _mm256_set1_epi32(128 * second));
    } else if (layout == 8) { /* only lo + hi is used */
        *lo = _mm256_add_epi32(*lo, _mm256_set1_epi32(128 * (first + second)));
    }
}

static inline __m256 load_partial8(const void *bias, int o, int out, const int bf16) {
    float v[8] = {0};
    if (bias != 0)
        for (int j = 0; j < 8 && o + j < out; j++)
            v[j] = bf16 ? bf16_to_f32(((const uint16_t *)bias)[o + j]) : ((const float *)bias)[o + j];
    return _mm256_loadu_ps(v);
}

static inline void store_partial8(void *y, int o, int out, __m256 acc, const int bf16) {
    float v[8];
    _mm256_storeu_ps(v, acc);
    for (int j = 0; j < 8 && o + j < out; j++) {
        if (bf16) ((uint16_t *)y)[o + j] = f32_to_bf16(v[j]);
        else ((float *)y)[o + j] = v[j];
    }
}

static inline __attribute__((always_inline)) void qblock(const int8_t *codes, const float *dx, const float *s,
                                                         const int32_t *sums_int, const uint8_t *packed,
                                                         const void *bias, void *y, int r0, const int rows, int ob,
                                                         int out, int in, const int layout, const int bf16) {
    const int blocks = in / QBLOCK;
    const int64_t rec = record_bytes(layout), code_bytes = (layout == 4 ? 4 : 8) * 64;
    __m256 acc[QROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const uint8_t *w = packed + (int64_t)ob * blocks * rec;
    for (int k = 0; k < blocks; k++, w += rec) {
        const float *factors = (const float *)(w + code_bytes);
        for (int half = 0; half < 2; half++) {
            __m256i c[8];
            unpack_codes(w, half, layout, c);
            const __m256 scale = _mm256_loadu_ps(factors + 8 * half), min = _mm256_loadu_ps(factors + 16 + 8 * half);
            const __m256 scale_hi = layout == 16 ? _mm256_loadu_ps(factors + 32 + 8 * half) : scale;
            const __m256 min_hi = layout == 16 ? _mm256_loadu_ps(factors + 48 + 8 * half) : min;
            for (int r = 0; r < rows; r++) {
                const int64_t row = r0 + r;
                __m256i lo, hi;
                const int32_t *ints = sums_int + (row * blocks + k) * 2;
                block_sums(c, codes + row * in + (int64_t)k * QBLOCK, ints[0], ints[1], layout, &lo, &hi);
                const __m256 d = _mm256_set1_ps(dx[row * blocks + k]);
                const float *sums = s + (row * blocks + k) * 3;
                __m256 a = acc[r][half];
                if (layout == 16) {
                    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(scale, d), a);
                    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(scale_hi, d), a);
                    a = _mm256_fmadd_ps(min, _mm256_set1_ps(sums[1]), a);
                    a = _mm256_fmadd_ps(min_hi, _mm256_set1_ps(sums[2]), a);
                } else {
                    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), _mm256_mul_ps(scale, d), a);
                    a = _mm256_fmadd_ps(min, _mm256_set1_ps(sums[0]), a);
                }
                acc[r][half] = a;
            }
        }
    }
    for (int half = 0; half < 2; half++) {
        const int o = ob * 16 + 8 * half;
        if (o >= out) break;
        const __m256 b = load_partial8(bias, o, out, bf16);
        for (int r = 0; r < rows; r++)
            store_partial8((char *)y + (int64_t)(r0 + r) * out * (bf16 ? 2 : 4), o, out, _mm256_add_ps(acc[r][half], b),
                           bf16);
    }
}

#endif

#if QUANTIZED_ISA
/* The 16-output blocks split among the threads, each over all rows: PASS_ROWS rows a pass, then
 * the last few, each count compiled with its own constant. */
static inline __attribute__((always_inline)) void qblocks_rows(const int8_t *codes, const float *dx, const float *s,
                                                               const int32_t *sums_int, const uint8_t *packed,
                                                               const void *bias, void *y, int num_rows, int out,
                                                               int in, const int layout, const int bf16) {
    const int out_blocks = (out + 15) / 16;
#pragma omp for schedule(static)
    for (int ob = 0; ob < out_blocks; ob++) {
        int r0 = 0;
        for (; r0 + PASS_ROWS <= num_rows; r0 += PASS_ROWS)
            qblock(codes, dx, s, sums_int, packed, bias, y, r0, PASS_ROWS, ob, out, in, layout, bf16);
        switch (num_rows - r0) { /* below PASS_ROWS: 7 at most */
            case 7: qblock(codes, dx, s, sums_int, packed, bias, y, r0, 7, ob, out, in, layout, bf16); break;
            case 6: qblock(codes, dx, s, sums_int, packed, bias, y, r0, 6, ob, out, in, layout, bf16); break;
            case 5: qblock(codes, dx, s, sums_int, packed, bias, y, r0, 5, ob, out, in, layout, bf16); break;
            case 4: qblock(codes, dx, s, sums_int, packed, bias, y, r0, 4, ob, out, in, layout, bf16); break;
            case 3: qblock(codes, dx, s, sums_int, packed, bias, y, r0, 3, ob, out, in, layout, bf16); break;
            case 2: qblock(codes, dx, s, sums_int, packed, bias, y, r0, 2, ob, out, in, layout, bf16); break;
            case 1: qblock(codes, dx, s, sums_int, packed, bias, y, r0, 1, ob, out, in, layout, bf16); break;
            default: break;
        }
    }
}
#endif

/* The work-sharing body (as linear.c's, for decoder.c): quantize x into the scratch, a barrier,
 * then the 16-output blocks split among the threads. scratch: rows * (in + 24 * in / 32) bytes. */
void linear_q_rows(const void *x, int64_t x_stride, const uint8_t *packed, const void *bias, void *y, int num_rows,
                   int out, int in, int layout, void *scratch, int bf16) {
#if QUANTIZED_ISA
    int8_t *codes = scratch;
    float *dx = (float *)(codes + (int64_t)num_rows * in), *s = dx + (int64_t)num_rows * (in / QBLOCK);
    int32_t *sums_int = (int32_t *)(s + (int64_t)num_rows * (in / QBLOCK) * 3);
    if (bf16)
        quantize_rows(x, x_stride, codes, dx, s, sums_int, num_rows, in, 1);
    else
        quantize_rows(x, x_stride, codes, dx, s, sums_int, num_rows, in, 0);
    /* the implicit barrier of quantize_rows' omp for: every row's codes are written */
    switch (layout * 2 + (bf16 != 0)) { /* each combination compiled with its constants */
        case 8: qblocks_rows(codes, dx, s, sums_int, packed, bias, y, num_rows, out, in, 4, 0); break;
        case 9: qblocks_rows(codes, dx, s, sums_int, packed, bias, y, num_rows, out, in, 4, 1); break;
        case 16: qblocks_rows(codes, dx, s, sums_int, packed, bias, y, num_rows, out, in, 8, 0); break;
        case 17: qblocks_rows(codes, dx, s, sums_int, packed, bias, y, num_rows, out, in, 8, 1); break;
        case 32: qblocks_rows(codes, dx, s, sums_int, packed, bias, y, num_rows, out, in, 16, 0); break;
        case 33: qblocks_rows(codes, dx, s, sums_int, packed, bias, y, num_rows, out, in, 16, 1); break;
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
    return QUANTIZED_ISA; /* 0: quantized files are served dequantized */
}
