/* y = x W^T (+ bias) with W kept quantized, as GGUF files store it, on CPUs with AVX-512 VNNI or AVX2.
 *
 * GGUF's block formats all say the same thing in different bit layouts: a row is cut into groups
 * of 32 (or 16) inputs, and weight j of a group is  scale * code_j + min  with small unsigned
 * integer codes (worker/model/quantized.py). worker/kernels/quant_records.py packs a weight for
 * this kernel in records of 16 outputs by 32 inputs (a block), keeping the file's own factors and
 * bit widths, so that a decode step reads about what the file holds:
 *
 *     codes    4 bits: 4 x 64 bytes, byte 4 o + i of vector v = code of input 4 v + i (low nibble)
 *                      and of input 4 (v + 4) + i (high nibble), for output o < 16
 *              5 bits: the same, then 64 bytes: bit g of byte 4 o + i = bit 4 of the code of input 4 g + i
 *              6 bits: the same, then 2 x 64 bytes: bits 2 j, 2 j + 1 of byte 4 o + i of vector h =
 *                      bits 4, 5 of the code of input 4 (4 h + j) + i
 *              8 bits: 8 x 64 bytes, byte 4 o + i of vector g = code of input 4 g + i
 *     factors  per part (the block's 32 inputs, or inputs 0-15 then 16-31 where groups are 16):
 *              16 scales, then 16 mins unless min = offset x scale; each a float32 ("float"),
 *              an fp16 ("half") or an int8 under the super-block's fp16 factors ("super")
 *
 * records ordered by 16-output block, then input block; "super" weights (the K-quants) have a
 * header before every 8 blocks (256 inputs): the 16 outputs' fp16 super-scales, then their fp16
 * super-mins unless min = offset x scale. The activations are quantized per row and 32-input
 * block to int8 (x ~ dx q, dx = max |x| / 127; s = dx * sum q), as llama.cpp does for its
 * quantized dot products, and a block's contribution to output o is
 *
 *     sum_j (scale_o c_j + min_o) dx q_j = scale_o dx (sum_j c_j q_j) + min_o s
 *
 * the integer sum by eight vpdpbusd (64 unsigned-by-signed byte products each), the rest two
 * fused multiply-adds on 16 outputs. The factors are widened to float32 in registers, exactly
 * (an fp16 times a small integer, or times a power of two), so every format computes in the same
 * float arithmetic. Every output sums its blocks in the same order whatever the number of rows
 * and wherever its row sits: a row's result does not depend on its batch.
 *
 * Without AVX-512 VNNI, AVX2 computes the same integer sums (exactly: vpmaddubsw's 16-bit pair
 * sums cannot saturate on codes below 64, and 8-bit codes are split into their two nibbles) and
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
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANTIZED_ISA 1
#else
#define QUANTIZED_ISA 0
#endif

#define QBLOCK 32   /* inputs per block */
#define QROWS 8     /* the most rows a pass takes (qblock's accumulators) */

/* A packed weight's format, one int (quant_records.py's PackedFormat.word): bits 0-3 the codes'
 * width (4, 5, 6, 8), 4-5 the factors' kind, 6 two parts (groups of 16), 7 mins stored, 8-11
 * the offset's power of two (min = -2^k scale where no mins are stored). */
enum { KIND_FLOAT = 0, KIND_HALF = 1, KIND_SUPER = 2 };
typedef struct {
    int bits, kind, parts, mins;
    float offset;
    int64_t code_bytes, part_bytes, record, header; /* header: before every 8 records ("super") */
} qformat;

static inline __attribute__((always_inline)) qformat parse_format(int word) {
    qformat f;
    f.bits = word & 15;
    f.kind = (word >> 4) & 3;
    f.parts = (word >> 6) & 1 ? 2 : 1;
    f.mins = (word >> 7) & 1;
    f.offset = -(float)(1 << ((word >> 8) & 15));
    const int unit = f.kind == KIND_FLOAT ? 64 : f.kind == KIND_HALF ? 32 : 16; /* 16 factors */
    f.code_bytes = f.bits == 8 ? 512 : 256 + 64 * (f.bits - 4);
    f.part_bytes = unit * (f.mins ? 2 : 1);
    f.record = f.code_bytes + f.parts * f.part_bytes;
    f.header = f.kind == KIND_SUPER ? 32 * (f.mins ? 2 : 1) : 0;
    return f;
}

/* The GGUF types' formats (quant_records.PackedFormat.word), each compiled as constants. */
#define WORD(bits, kind, two_parts, mins, shift) ((bits) | (kind) << 4 | (two_parts) << 6 | (mins) << 7 | (shift) << 8)
#define WORD_Q4_0 WORD(4, KIND_HALF, 0, 0, 3)
#define WORD_Q4_1 WORD(4, KIND_HALF, 0, 1, 0)
#define WORD_Q4_K WORD(4, KIND_SUPER, 0, 1, 0)
#define WORD_Q5_0 WORD(5, KIND_HALF, 0, 0, 4)
#define WORD_Q5_1 WORD(5, KIND_HALF, 0, 1, 0)
#define WORD_Q5_K WORD(5, KIND_SUPER, 0, 1, 0)
#define WORD_Q8_0 WORD(8, KIND_HALF, 0, 0, 7)
#define WORD_Q6_K WORD(6, KIND_SUPER, 1, 0, 5)

/* How block_sums on AVX2 sums a width of codes: 4 (below 32), 6 (below 64) or 8 (bytes). */
static inline int width_of(int bits) { return bits == 8 ? 8 : bits == 6 ? 6 : 4; }

/* Where the records of 16-output block ob start. */
static inline const uint8_t *records_of(const uint8_t *packed, const qformat *f, int ob, int blocks) {
    return packed + (int64_t)ob * (blocks * f->record + blocks / 8 * f->header);
}

/* ------------------------------------------------------------------ activations */

/* x [rows, in] (rows x_stride apart) -> codes [in / 32, rows, 32] int8, dx [in / 32, rows],
 * s [in / 32, rows, 3]: dx times the sum of the codes of the block, of its first 16 and of its
 * last 16, and those last two sums as integers, sums [in / 32, rows, 2] (the AVX2 path's
 * correction for 8-bit codes). ACTS: block-major, so that a pass finds block k of its rows at
 * one pointer and constant offsets; row-major, each row took a register of its own and the
 * eight rows of a pass spilled them. */
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
            const float a = fabsf(v[j]);
            amax = a > amax ? a : amax; /* not fmaxf: a library call per value (its NaN rule) */
        }
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const int64_t at = (int64_t)k * num_rows + r; /* block-major: see ACTS */
        int8_t *q = codes + at * QBLOCK;
        for (int j = 0; j < QBLOCK; j++) q[j] = (int8_t)(int)nearbyintf(v[j] * inv);
        int first = 0, second = 0; /* two plain reductions: they vectorise */
        for (int j = 0; j < QBLOCK / 2; j++) first += q[j];
        for (int j = QBLOCK / 2; j < QBLOCK; j++) second += q[j];
        dx[at] = d;
        float *sums = s + at * 3;
        sums[0] = d * (float)(first + second);
        sums[1] = d * (float)first;
        sums[2] = d * (float)second;
        if (QUANTIZED_ISA == 1) { /* only the AVX2 path reads them */
            sums_int[at * 2] = first;
            sums_int[at * 2 + 1] = second;
        }
    }
}

/* ------------------------------------------------------------------ the product */

#if QUANTIZED_ISA == 2
#include "simd.h"

#define PASS_ROWS QROWS /* 8 accumulators + 8 weight vectors + scale, min stay in registers */

/* A row's codes of inputs 4 g .. 4 g + 3 in every 32-bit lane: one broadcast load from where they
 * lie (through a register, the compiler had made it a scalar load, a shift and a vector move for
 * every group of every row: a third of the loop's instructions). */
static inline __m512i four_codes(const int8_t *q, int g) {
    int32_t v;
    memcpy(&v, q + 4 * g, sizeof v);
    return _mm512_set1_epi32(v);
}

/* The block's codes as wg[g], the codes of inputs 4 g .. 4 g + 3 of the 16 outputs (64 bytes). */
static inline __attribute__((always_inline)) void unpack_codes(const uint8_t *w, int bits, __m512i *wg) {
    if (bits == 8) {
        for (int g = 0; g < 8; g++) wg[g] = _mm512_loadu_si512(w + 64 * g);
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int v = 0; v < 4; v++) {
        const __m512i c = _mm512_loadu_si512(w + 64 * v);
        wg[v] = _mm512_and_si512(c, low);
        wg[v + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
    }
    /* the high bits: where a plane's bit is set, add its weight to the code */
    for (int h = 0; h < bits - 4; h++) {
        const __m512i plane = _mm512_loadu_si512(w + 256 + 64 * h);
        for (int n = 0; n < (bits == 5 ? 8 : 4); n++) {
            const int g = bits == 5 ? n : 4 * h + n;
            for (int b = 0; b < bits - 4; b++) {
                const int bit = bits == 5 ? n : 2 * n + b;
                const __mmask64 set = _mm512_test_epi8_mask(plane, _mm512_set1_epi8((char)(1 << bit)));
                wg[g] = _mm512_mask_add_epi8(wg[g], set, wg[g], _mm512_set1_epi8((char)(16 << b)));
            }
        }
    }
}

/* Part p's 16 scales and mins as float32 (header: the super-block's factors, "super" only). */
static inline __attribute__((always_inline)) void load_factors(const uint8_t *w, const qformat f,
                                                               const uint8_t *header, int p, __m512 *scale,
                                                               __m512 *min) {
    const uint8_t *at = w + f.code_bytes + p * f.part_bytes;
    if (f.kind == KIND_FLOAT) {
        *scale = _mm512_loadu_ps(at);
        if (f.mins) *min = _mm512_loadu_ps(at + 64);
    } else if (f.kind == KIND_HALF) {
        *scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
        if (f.mins) *min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + 32)));
    } else {
        const __m512 super_scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)header));
        *scale = _mm512_mul_ps(super_scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)at))));
        if (f.mins) {
            const __m512 super_min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(header + 32)));
            *min = _mm512_mul_ps(super_min,
                                 _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(at + 16)))));
        }
    }
    if (!f.mins) *min = _mm512_mul_ps(*scale, _mm512_set1_ps(f.offset));
}

/* Rows r0 .. r0 + rows - 1 by the 16 outputs of block ob; rows, parts and bf16 constants where inlined. */
static inline __attribute__((always_inline)) void qblock(const int8_t *codes, const float *dx, const float *s,
                                                         const int32_t *sums_int, const uint8_t *packed,
                                                         const qformat f, const void *bias, void *y, int r0,
                                                         const int rows, int num_rows, int ob, int out, int in,
                                                         const int parts, const int width, int bf16) {
    (void)sums_int, (void)width; /* vpdpbusd multiplies unsigned bytes by signed ones: no correction, any width */
    const int blocks = in / QBLOCK;
    const uint8_t *w = records_of(packed, &f, ob, blocks), *header = 0;
    __m512 acc[QROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int k = 0; k < blocks; k++, w += f.record) {
        if (f.header && k % 8 == 0) {
            header = w;
            w += f.header;
        }
        __m512i wg[8];
        unpack_codes(w, f.bits, wg);
        __m512 scale, min, scale_hi, min_hi;
        load_factors(w, f, header, 0, &scale, &min);
        if (parts == 2) load_factors(w, f, header, 1, &scale_hi, &min_hi);
        else scale_hi = scale, min_hi = min;
        for (int r = 0; r < rows; r++) {
            const int64_t row = r0 + r;
            const int64_t at = (int64_t)k * num_rows + row;
            const int8_t *q = codes + at * QBLOCK;
            /* two chains, half the latency: inputs 0-15 and 16-31 where two parts scale them
             * apart, else alternate groups (as the 4-bit vectors unpack) */
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            for (int g = 0; g < 4; g++) {
                const int a = parts == 2 ? g : 2 * g, b = parts == 2 ? g + 4 : 2 * g + 1;
                lo = _mm512_dpbusd_epi32(lo, wg[a], four_codes(q, a));
                hi = _mm512_dpbusd_epi32(hi, wg[b], four_codes(q, b));
            }
            const __m512 d = _mm512_set1_ps(dx[at]);
            const float *sums = s + at * 3;
            if (parts == 2) {
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

/* x shifted left by n bits (right by -n) in each 16-bit lane. */
static inline __m256i shift16(__m256i x, int n) {
    return n >= 0 ? _mm256_sll_epi16(x, _mm_cvtsi32_si128(n)) : _mm256_srl_epi16(x, _mm_cvtsi32_si128(-n));
}

/* One block's codes of 8 outputs, unpacked once for all rows into c[g], group g's 32 bytes.
 * 8-bit codes as the signed c - 128, which vpmaddubsw takes as its magnitude and the
 * activation's sign flipped by the code's: c q = (c - 128) q + 128 q. The high bits of 5- and
 * 6-bit codes are shifted from their plane into place (a 16-bit shift: what crosses from the
 * neighbouring byte lands outside the mask). */
static inline __attribute__((always_inline)) void unpack_codes(const uint8_t *w, int half, int bits, const int width,
                                                               __m256i *c) {
    if (width == 8) {
        for (int g = 0; g < 8; g++)
            c[g] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 64 * g + 32 * half)),
                                    _mm256_set1_epi8((char)0x80));
        return;
    }
    for (int g = 0; g < 8; g++) { /* groups g and g + 4 share a vector: low and high nibbles */
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(w + 64 * (g % 4) + 32 * half));
        c[g] = _mm256_and_si256(g < 4 ? packed : _mm256_srli_epi16(packed, 4), _mm256_set1_epi8(0x0F));
    }
    if (width == 4 && bits == 5) {
        const __m256i plane = _mm256_loadu_si256((const __m256i *)(w + 256 + 32 * half));
        for (int g = 0; g < 8; g++)
            c[g] = _mm256_or_si256(c[g], _mm256_and_si256(shift16(plane, 4 - g), _mm256_set1_epi8(0x10)));
    } else if (width == 6) {
        for (int g = 0; g < 8; g++) {
            const __m256i plane = _mm256_loadu_si256((const __m256i *)(w + 256 + 64 * (g / 4) + 32 * half));
            c[g] = _mm256_or_si256(c[g], _mm256_and_si256(shift16(plane, 4 - 2 * (g % 4)), _mm256_set1_epi8(0x30)));
        }
    }
}

/* The row's codes of inputs 4 g .. 4 g + 3 in every 32-bit lane: one broadcast from where they lie. */
static inline __m256i four_codes(const int8_t *q, int g) {
    int32_t v;
    memcpy(&v, q + 4 * g, sizeof v);
    return _mm256_set1_epi32(v);
}

/* 8 outputs' integer sums over one block for one row: lo over the groups the VNNI kernel sums in
 * its lo chain, hi over the others (the order is immaterial: integer sums are exact). width: 4
 * for codes below 32, 6 below 64, 8 for bytes. Codes below 64 go straight to vpmaddubsw, whose
 * 16-bit pair sums stay below 2^15 summed over four groups (codes below 32: 4 x 31 x 127 x 2) or
 * two (below 64); 8-bit codes by the sign trick, corrected by first, second: the row's integer
 * sums of the block's first and last 16 activations. */
static inline __attribute__((always_inline)) void block_sums(const __m256i *c, const int8_t *q, int32_t first,
                                                             int32_t second, const int width, const int parts,
                                                             __m256i *lo, __m256i *hi) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (width < 8) {
        const int per_sum = width == 6 ? 2 : 4; /* groups summed in 16 bits before widening */
        __m256i chain[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int ch = 0; ch < 2; ch++)
            for (int start = 0; start < 4; start += per_sum) {
                __m256i pairs = _mm256_setzero_si256();
                for (int n = start; n < start + per_sum; n++) {
                    const int g = parts == 2 ? 4 * ch + n : 2 * n + ch;
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(c[g], four_codes(q, g)));
                }
                chain[ch] = _mm256_add_epi32(chain[ch], _mm256_madd_epi16(pairs, ones));
            }
        *lo = chain[0];
        *hi = chain[1];
        return;
    }
    *lo = _mm256_setzero_si256();
    *hi = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) {
        const __m256i acts = four_codes(q, g);
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c[g]), _mm256_sign_epi8(acts, c[g])),
                                              ones);
        const int in_lo = parts == 2 ? g < 4 : g % 2 == 0;
        if (in_lo) *lo = _mm256_add_epi32(*lo, dot);
        else *hi = _mm256_add_epi32(*hi, dot);
    }
    if (parts == 2) { /* lo: inputs 0-15, hi: 16-31 */
        *lo = _mm256_add_epi32(*lo, _mm256_set1_epi32(128 * first));
        *hi = _mm256_add_epi32(*hi, _mm256_set1_epi32(128 * second));
    } else { /* only lo + hi is used */
        *lo = _mm256_add_epi32(*lo, _mm256_set1_epi32(128 * (first + second)));
    }
}

/* Part p's scales and mins of the 8 outputs of this half, as float32 (the VNNI kernel's, lane for lane). */
static inline __attribute__((always_inline)) void load_factors(const uint8_t *w, const qformat f,
                                                               const uint8_t *header, int p, int half, __m256 *scale,
                                                               __m256 *min) {
    const uint8_t *at = w + f.code_bytes + p * f.part_bytes;
    if (f.kind == KIND_FLOAT) {
        *scale = _mm256_loadu_ps((const float *)at + 8 * half);
        if (f.mins) *min = _mm256_loadu_ps((const float *)(at + 64) + 8 * half);
    } else if (f.kind == KIND_HALF) {
        *scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 16 * half)));
        if (f.mins) *min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + 32 + 16 * half)));
    } else {
        const __m256 super_scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(header + 16 * half)));
        *scale = _mm256_mul_ps(super_scale,
                               _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(at + 8 * half)))));
        if (f.mins) {
            const __m256 super_min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(header + 32 + 16 * half)));
            *min = _mm256_mul_ps(super_min, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                _mm_loadl_epi64((const __m128i *)(at + 16 + 8 * half)))));
        }
    }
    if (!f.mins) *min = _mm256_mul_ps(*scale, _mm256_set1_ps(f.offset));
}

/* Outputs o .. o + 7 of a bias (0 without one, and past out), and of a row of y (those below
 * out): whole vectors but at a row's edge. (Not simd.h's: on AVX-512 without VNNI its vectors
 * are 16 wide, and this path still runs.) */
static inline __m256 load_partial8(const void *bias, int o, int out, const int bf16) {
    if (bias == 0) return _mm256_setzero_ps();
    if (out - o >= 8 && !bf16) return _mm256_loadu_ps((const float *)bias + o);
    if (out - o >= 8)
        return _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)bias + o))), 16));
    float v[8] = {0};
    for (int j = 0; j < 8 && o + j < out; j++)
        v[j] = bf16 ? bf16_to_f32(((const uint16_t *)bias)[o + j]) : ((const float *)bias)[o + j];
    return _mm256_loadu_ps(v);
}

static inline void store_partial8(void *y, int o, int out, __m256 acc, const int bf16) {
    if (out - o >= 8 && !bf16) {
        _mm256_storeu_ps((float *)y + o, acc);
        return;
    }
    float v[8];
    _mm256_storeu_ps(v, acc);
    for (int j = 0; j < 8 && o + j < out; j++) {
        if (bf16) ((uint16_t *)y)[o + j] = f32_to_bf16(v[j]);
        else ((float *)y)[o + j] = v[j];
    }
}

static inline __attribute__((always_inline)) void qblock(const int8_t *codes, const float *dx, const float *s,
                                                         const int32_t *sums_int, const uint8_t *packed,
                                                         const qformat f, const void *bias, void *y, int r0,
                                                         const int rows, int num_rows, int ob, int out, int in,
                                                         const int parts, const int width, int bf16) {
    const int blocks = in / QBLOCK;
    __m256 acc[QROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const uint8_t *w = records_of(packed, &f, ob, blocks), *header = 0;
    for (int k = 0; k < blocks; k++, w += f.record) {
        if (f.header && k % 8 == 0) {
            header = w;
            w += f.header;
        }
        for (int half = 0; half < 2; half++) {
            __m256i c[8];
            unpack_codes(w, half, f.bits, width, c);
            __m256 scale, min, scale_hi, min_hi;
            load_factors(w, f, header, 0, half, &scale, &min);
            if (parts == 2) load_factors(w, f, header, 1, half, &scale_hi, &min_hi);
            else scale_hi = scale, min_hi = min;
            for (int r = 0; r < rows; r++) {
                const int64_t row = r0 + r;
                __m256i lo, hi;
                const int64_t at = (int64_t)k * num_rows + row;
                const int32_t *ints = sums_int + at * 2;
                block_sums(c, codes + at * QBLOCK, ints[0], ints[1], width, parts, &lo, &hi);
                const __m256 d = _mm256_set1_ps(dx[at]);
                const float *sums = s + at * 3;
                __m256 a = acc[r][half];
                if (parts == 2) {
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
#ifndef ROW_CHUNK
#define ROW_CHUNK 64
#endif

/* The 16-output blocks split among the threads, ROW_CHUNK rows at a time (so that a chunk's
 * activations and a thread's share of the weight stay in its L2 cache: all 4,096 rows of a long
 * prompt at once streamed the activations from memory for every block, at half the speed), each
 * chunk PASS_ROWS rows a pass, then the last few, each count compiled with its own constant. A
 * thread takes the same blocks in every chunk (a static schedule of the same loop) and only reads
 * what the quantization wrote before its barrier: the chunks need none between them. */
static inline __attribute__((always_inline)) void qblocks_rows(const int8_t *codes, const float *dx, const float *s,
                                                               const int32_t *sums_int, const uint8_t *packed,
                                                               const qformat f, const void *bias, void *y,
                                                               int num_rows, int out, int in, const int parts,
                                                               const int width, int bf16) {
    const int out_blocks = (out + 15) / 16;
    for (int chunk = 0; chunk < num_rows; chunk += ROW_CHUNK) {
        const int chunk_end = num_rows - chunk > ROW_CHUNK ? chunk + ROW_CHUNK : num_rows;
#pragma omp for schedule(static) nowait
        for (int ob = 0; ob < out_blocks; ob++) {
            int r0 = chunk;
            for (; r0 + PASS_ROWS <= chunk_end; r0 += PASS_ROWS)
                qblock(codes, dx, s, sums_int, packed, f, bias, y, r0, PASS_ROWS, num_rows, ob, out, in, parts, width, bf16);
            switch (chunk_end - r0) { /* below PASS_ROWS: 7 at most */
                case 7: qblock(codes, dx, s, sums_int, packed, f, bias, y, r0, 7, num_rows, ob, out, in, parts, width, bf16); break;
                case 6: qblock(codes, dx, s, sums_int, packed, f, bias, y, r0, 6, num_rows, ob, out, in, parts, width, bf16); break;
                case 5: qblock(codes, dx, s, sums_int, packed, f, bias, y, r0, 5, num_rows, ob, out, in, parts, width, bf16); break;
                case 4: qblock(codes, dx, s, sums_int, packed, f, bias, y, r0, 4, num_rows, ob, out, in, parts, width, bf16); break;
                case 3: qblock(codes, dx, s, sums_int, packed, f, bias, y, r0, 3, num_rows, ob, out, in, parts, width, bf16); break;
                case 2: qblock(codes, dx, s, sums_int, packed, f, bias, y, r0, 2, num_rows, ob, out, in, parts, width, bf16); break;
                case 1: qblock(codes, dx, s, sums_int, packed, f, bias, y, r0, 1, num_rows, ob, out, in, parts, width, bf16); break;
                default: break;
            }
        }
    }
#pragma omp barrier
}
#endif

/* The work-sharing body (as linear.c's, for decoder.c): quantize x into the scratch, a barrier,
 * then the 16-output blocks split among the threads. scratch: rows * (in + 24 * in / 32) bytes. */
void linear_q_rows(const void *x, int64_t x_stride, const uint8_t *packed, const void *bias, void *y, int num_rows,
                   int out, int in, int format, void *scratch, int bf16) {
#if QUANTIZED_ISA
    int8_t *codes = scratch;
    float *dx = (float *)(codes + (int64_t)num_rows * in), *s = dx + (int64_t)num_rows * (in / QBLOCK);
    int32_t *sums_int = (int32_t *)(s + (int64_t)num_rows * (in / QBLOCK) * 3);
    if (bf16)
        quantize_rows(x, x_stride, codes, dx, s, sums_int, num_rows, in, 1);
    else
        quantize_rows(x, x_stride, codes, dx, s, sums_int, num_rows, in, 0);
    /* the implicit barrier of quantize_rows' omp for: every row's codes are written */
    /* Each combination compiled with its constants: the row loop's (parts; on AVX2 the codes'
     * width too, as block_sums sums them), and for the GGUF types the whole format, so that
     * unpacking and widening a block's factors are straight-line code. bf16 is only read at
     * the store, once a pass. */
#define CALL_ROWS(f, parts, width)                                                                            \
    do {                                                                                                  \
        qblocks_rows(codes, dx, s, sums_int, packed, f, bias, y, num_rows, out, in, parts, width, bf16); \
    } while (0)
#define KNOWN(word) \
    case word: CALL_ROWS(parse_format(word), ((word) >> 6 & 1) + 1, width_of((word) & 15)); break
    switch (format) {
#if QUANTIZED_ISA == 2
        KNOWN(WORD_Q4_0);
        KNOWN(WORD_Q4_1);
        KNOWN(WORD_Q4_K);
        KNOWN(WORD_Q5_0);
        KNOWN(WORD_Q5_1);
        KNOWN(WORD_Q5_K);
        KNOWN(WORD_Q8_0);
        KNOWN(WORD_Q6_K);
#endif
        default: { /* the float form of stacked mixed types: the format read as it goes */
            const qformat f = parse_format(format);
            const int width = QUANTIZED_ISA == 1 ? width_of(f.bits) : 0; /* VNNI's row loop: any width */
            if (f.parts == 2) {
                if (width == 8) CALL_ROWS(f, 2, 8);
                else if (width == 6) CALL_ROWS(f, 2, 6);
                else CALL_ROWS(f, 2, 4);
            } else {
                if (width == 8) CALL_ROWS(f, 1, 8);
                else if (width == 6) CALL_ROWS(f, 1, 6);
                else CALL_ROWS(f, 1, 4);
            }
        }
    }
#endif
}

/* x [num_rows, in] float32 or bfloat16 (bf16 says which; y the same), in a multiple of 32 (of 256
 * for "super" formats); packed as above in format (PackedFormat.word); bias [out] or
 * NULL. A no-op where linear_q_available() is 0. */
void linear_q(const void *x, int64_t x_stride, const uint8_t *packed, const void *bias, void *y, int num_rows, int out,
              int in, int format, void *scratch, int bf16, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    linear_q_rows(x, x_stride, packed, bias, y, num_rows, out, in, format, scratch, bf16);
}

/* ------------------------------------------------------------------ rows read back */

/* An fp16 as float32, exactly (no F16C here: this runs in every build). */
static inline float half_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24, exact in float32 */
        const float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | mant << 13 : (exp + 112) << 23 | mant << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Factor `lane` of the 16 at `at`, widened: a float32, an fp16, or an int8 times its super-factor. */
static inline float factor_of(const uint8_t *at, int kind, int lane, const uint8_t *super) {
    if (kind == KIND_FLOAT) {
        float v;
        memcpy(&v, at + 4 * lane, sizeof v);
        return v;
    }
    uint16_t h;
    if (kind == KIND_HALF) {
        memcpy(&h, at + 2 * lane, sizeof h);
        return half_to_f32(h);
    }
    memcpy(&h, super + 2 * lane, sizeof h);
    return half_to_f32(h) * (float)(int8_t)at[lane]; /* exact: 11 bits times 8 */
}

/* Rows ids[0..n-1] of a weight packed in `format` (out rows, in inputs) back as float32 out [n, in]:
 * a tied embedding's lookup, in the arithmetic of quant_records.unpack(...).dequantize(), code times
 * scale rounded, then plus min rounded, so the values are the same bit for bit. One call does what
 * that took a few dozen torch operators for. Returns -1, having written nothing, if an id is not
 * a row; 0 otherwise. Plain C: every build has it, whatever the product kernel's instructions. */
int dequantize_rows(const uint8_t *packed, int format, int out, int in, const int64_t *ids, int n, float *y) {
    const qformat f = parse_format(format);
    const int blocks = in / QBLOCK, unit = f.kind == KIND_FLOAT ? 64 : f.kind == KIND_HALF ? 32 : 16;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= out) return -1;
    for (int i = 0; i < n; i++) {
        const int lane = (int)(ids[i] % 16);
        const uint8_t *w = records_of(packed, &f, (int)(ids[i] / 16), blocks), *header = 0;
        float *row = y + (int64_t)i * in;
        for (int k = 0; k < blocks; k++, w += f.record) {
            if (f.header && k % 8 == 0) {
                header = w;
                w += f.header;
            }
            for (int g = 0; g < 8; g++) {
                const int p = f.parts == 2 ? g / 4 : 0; /* two parts: inputs 0-15, then 16-31 */
                const uint8_t *at = w + f.code_bytes + p * f.part_bytes;
                const float scale = factor_of(at, f.kind, lane, header);
                const float min = f.mins ? factor_of(at + unit, f.kind, lane, header ? header + 32 : 0)
                                         : scale * f.offset; /* a power of two: exact */
                for (int j = 0; j < 4; j++) {
                    const int b = 4 * lane + j;
                    int code;
                    if (f.bits == 8) {
                        code = w[64 * g + b];
                    } else {
                        const int byte = w[64 * (g & 3) + b];
                        code = g < 4 ? byte & 15 : byte >> 4;
                        if (f.bits == 5) code |= ((w[256 + b] >> g) & 1) << 4;
                        if (f.bits == 6) code |= ((w[256 + 64 * (g / 4) + b] >> (2 * (g % 4))) & 3) << 4;
                    }
                    const float scaled = (float)code * scale;
                    row[k * QBLOCK + 4 * g + j] = scaled + min;
                }
            }
        }
    }
    return 0;
}

int linear_q_available(void) {
    return QUANTIZED_ISA; /* 0: quantized files are served dequantized */
}
