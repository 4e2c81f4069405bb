/* AVX-512 helpers shared by the kernels: 16 float32 or bfloat16 values loaded as float32 and
 * stored back (bfloat16 rounded to nearest even, as torch rounds), and exp of 16 floats. */
#ifndef SLUICE_SIMD_H
#define SLUICE_SIMD_H
#ifdef __AVX512F__
#include <immintrin.h>
#include <stdint.h>

static inline __m512 load16(const void *base, int64_t i, const int bf16) {
    if (bf16) {
        const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    return _mm512_loadu_ps((const float *)base + i);
}

/* v's bits rounded to bfloat16 (nearest even, as f32_to_bf16), still in the top halves. */
static inline __m512i bf16_rounded_bits(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
}

/* v rounded to bfloat16 and widened back to float32. */
static inline __m512 round_to_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_srli_epi32(bf16_rounded_bits(v), 16), 16));
}

static inline void store16(void *base, int64_t i, __m512 v, const int bf16) {
    if (bf16) {
        const __m512i rounded = bf16_rounded_bits(v);
        _mm256_storeu_si256((__m256i *)((uint16_t *)base + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
    } else {
        _mm512_storeu_ps((float *)base + i, v);
    }
}

/* exp(x): 2^(x log2 e) split into an integer n and f in [-1/2, 1/2]; 2^f by its Taylor series to
 * degree 6 (relative error ~1e-7, float32's own), then scaled by 2^n. Below 2^-126 the result is
 * that tiny value instead of 0, which no softmax sum notices; past 2^128 it is infinity (silu of a
 * very negative input then gives -0, as torch's does). Not torch's exp bit for bit: silu through
 * it may differ from torch's by one unit in the last place, the same in both of Sluice's paths. */
static inline __m512 exp512(__m512 x) {
    __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The sums of a, b, c and d's sixteen lanes, as one vector of four: pairwise within each 128-bit
 * lane, then across the four lanes. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512d ab_d = _mm512_castps_pd(ab), cd_d = _mm512_castps_pd(cd);
    const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab_d, cd_d)),
                                      _mm512_castpd_ps(_mm512_unpackhi_pd(ab_d, cd_d)));
    const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}

/* Outputs o .. min(o + 16, out) - 1 of a row: a bias's (0 where absent or past the end), and a
 * store of v's lanes to them (bfloat16 rounded as store16 rounds). */
static inline __mmask16 lanes_below(int o, int out) {
    return out - o >= 16 ? 0xFFFF : (__mmask16)((1u << (out - o)) - 1);
}

static inline __m512 load_partial16(const void *bias, int o, int out, const int bf16) {
    if (bias == 0 || o >= out) return _mm512_setzero_ps();
    if (bf16) {
        const __m256i half = _mm256_maskz_loadu_epi16(lanes_below(o, out), (const uint16_t *)bias + o);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    return _mm512_maskz_loadu_ps(lanes_below(o, out), (const float *)bias + o);
}

static inline void store_partial16(void *y, int o, int out, __m512 v, const int bf16) {
    if (o >= out) return;
    if (bf16) { /* round to nearest even, as torch does */
        _mm256_mask_storeu_epi16((uint16_t *)y + o, lanes_below(o, out),
                                 _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(v), 16)));
    } else {
        _mm512_mask_storeu_ps((float *)y + o, lanes_below(o, out), v);
    }
}

#endif
#endif
