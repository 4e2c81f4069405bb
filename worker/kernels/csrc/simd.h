/* Vector helpers shared by the kernels.
 *
 * First the AVX-512 ones: 16 float32 or bfloat16 values loaded as float32 and stored back
 * (bfloat16 rounded to nearest even, as torch rounds).
 *
 * Then `vf`, a vector of VL float32 lanes of either width: 16 with AVX-512, 8 with AVX2 and FMA
 * (x86-64-v3), no VL at all below that. A kernel whose shape is the same on both instruction sets
 * is written once over vf (linear.c, silu in decoder.c): the same operations lane by lane, so a
 * lane's result is the same bits on either set. */
#ifndef SLUICE_SIMD_H
#define SLUICE_SIMD_H
#include <stdint.h>

#include "bf16.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#ifdef __AVX512F__

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

#endif /* __AVX512F__ */

/* ------------------------------------------------------------------ vf: VL lanes of either width */

#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vloadu(const void *p) { return _mm512_loadu_ps((const float *)p); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vload(const void *base, int64_t i, const int bf16) { return load16(base, i, bf16); }
static inline void vstore(void *base, int64_t i, vf v, const int bf16) { store16(base, i, v, bf16); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vround_nearest(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vscale_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); } /* p 2^n, rounded once */
static inline vf vround_bf16(vf v) { return round_to_bf16(v); }
static inline vf vload_partial(const void *p, int o, int out, const int bf16) { return load_partial16(p, o, out, bf16); }
static inline void vstore_partial(void *y, int o, int out, vf v, const int bf16) { store_partial16(y, o, out, v, bf16); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float vreduce_max(vf v) { return _mm512_reduce_max_ps(v); }
static inline float vreduce_add(vf v) { return _mm512_reduce_add_ps(v); }
/* v's lanes lo .. hi - 1 (those of them in 0 .. VL - 1), the rest fill. */
static inline vf vkeep_range(vf v, int lo, int hi, float fill) {
    if (lo <= 0 && hi >= 16) return v;
    const unsigned below_hi = hi >= 16 ? 0xFFFFu : hi <= 0 ? 0u : (1u << hi) - 1;
    const unsigned below_lo = lo >= 16 ? 0xFFFFu : lo <= 0 ? 0u : (1u << lo) - 1;
    return _mm512_mask_blend_ps((__mmask16)(below_hi & ~below_lo), _mm512_set1_ps(fill), v);
}
/* Lane by lane: if_below where x < limit, else otherwise. */
static inline vf vblend_below(vf x, float limit, vf if_below, vf otherwise) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_LT_OQ), otherwise, if_below);
}
/* v, but x where x is NaN. */
static inline vf vkeep_nan(vf x, vf v) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), v, x); }
/* A vector of VL bfloat16 pairs (2 VL values) as float32: each pair's first, and its second. */
static inline vf vpair_first(vf pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(pairs), 16)); }
static inline vf vpair_second(vf pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(pairs), _mm512_set1_epi32((int)0xFFFF0000u)));
}

#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline vf vloadu(const void *p) { return _mm256_loadu_ps((const float *)p); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }

static inline vf vload(const void *base, int64_t i, const int bf16) {
    if (bf16) {
        const __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    }
    return _mm256_loadu_ps((const float *)base + i);
}

/* v's bits rounded to bfloat16 (nearest even), still in the top halves. */
static inline __m256i bf16_rounded_bits8(vf v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
}

static inline vf vround_bf16(vf v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(bf16_rounded_bits8(v), 16), 16));
}

static inline void vstore(void *base, int64_t i, vf v, const int bf16) {
    if (bf16) { /* the eight 16-bit halves packed (packus works per 128-bit lane: lanes 0 and 2 hold them) */
        const __m256i top = _mm256_srli_epi32(bf16_rounded_bits8(v), 16);
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0x08);
        _mm_storeu_si128((__m128i *)((uint16_t *)base + i), _mm256_castsi256_si128(packed));
    } else {
        _mm256_storeu_ps((float *)base + i, v);
    }
}

static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vround_nearest(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

/* p 2^n for integral n in [-126, 254], rounded once as vscalefps rounds: 2^n as two exact halves. */
static inline vf vscale_pow2(vf p, vf n) {
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i low = _mm256_srai_epi32(ni, 1), high = _mm256_sub_epi32(ni, low); /* each in [-63, 127] */
    const __m256 two_low = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(low, _mm256_set1_epi32(127)), 23));
    const __m256 two_high = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(high, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, two_low), two_high);
}

/* Outputs o .. min(o + 8, out) - 1 (0 past the end or without p); at a row's edge, plain loops. */
static inline vf vload_partial(const void *p, int o, int out, const int bf16) {
    if (p == 0) return vzero();
    if (out - o >= 8) return vload(p, o, bf16);
    float lanes[8] = {0};
    for (int k = 0; p != 0 && k < 8 && o + k < out; k++)
        lanes[k] = bf16 ? bf16_to_f32(((const uint16_t *)p)[o + k]) : ((const float *)p)[o + k];
    return _mm256_loadu_ps(lanes);
}

static inline void vstore_partial(void *y, int o, int out, vf v, const int bf16) {
    if (out - o >= 8) {
        vstore(y, o, v, bf16);
        return;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    for (int k = 0; o + k < out; k++) {
        if (bf16)
            ((uint16_t *)y)[o + k] = f32_to_bf16(lanes[k]);
        else
            ((float *)y)[o + k] = lanes[k];
    }
}

static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }

static inline float vreduce_max(vf v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline float vreduce_add(vf v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline vf vkeep_range(vf v, int lo, int hi, float fill) {
    if (lo <= 0 && hi >= 8) return v;
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(lane, _mm256_set1_ps((float)lo), _CMP_GE_OQ),
                                      _mm256_cmp_ps(lane, _mm256_set1_ps((float)hi), _CMP_LT_OQ));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), v, keep);
}

static inline vf vblend_below(vf x, float limit, vf if_below, vf otherwise) {
    return _mm256_blendv_ps(otherwise, if_below, _mm256_cmp_ps(x, _mm256_set1_ps(limit), _CMP_LT_OQ));
}

static inline vf vkeep_nan(vf x, vf v) { return _mm256_blendv_ps(v, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }

static inline vf vpair_first(vf pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(pairs), 16)); }
static inline vf vpair_second(vf pairs) {
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(pairs), _mm256_set1_epi32((int)0xFFFF0000u)));
}
#endif /* VL */

#ifdef VL
/* exp(x): 2^(x log2 e) split into an integer n and f in [-1/2, 1/2]; 2^f by its Taylor series to
 * degree 6 (relative error ~1e-7, float32's own), then scaled by 2^n. Below 2^-126 the result is
 * that tiny value instead of 0, which no softmax sum notices; past 2^128 it is infinity (silu of a
 * very negative input then gives -0, as torch's does). Not torch's exp bit for bit: silu through
 * it may differ from torch's by one unit in the last place, the same in both of Sluice's paths.
 * The same operations lane for lane on either width: silu gives the same bits on both sets. */
static inline vf vexp(vf x) {
    vf t = vmax(vmul(x, vset1(1.44269504088896341f)), vset1(-126.0f));
    t = vmin(t, vset1(254.0f)); /* past 2^128 either way: infinity */
    const vf n = vround_nearest(t);
    const vf f = vmul(vsub(t, n), vset1(0.69314718055994531f));
    vf p = vset1(1.0f / 720.0f);
    p = vfma(p, f, vset1(1.0f / 120.0f));
    p = vfma(p, f, vset1(1.0f / 24.0f));
    p = vfma(p, f, vset1(1.0f / 6.0f));
    p = vfma(p, f, vset1(0.5f));
    p = vfma(p, f, vset1(1.0f));
    p = vfma(p, f, vset1(1.0f));
    return vscale_pow2(p, n);
}

/* tanh(x), relative error ~3e-7: (1 - e) / (1 + e) with e = exp(-2x), x clamped to [-9, 9]
 * (beyond, tanh is +-1 within 3e-8); below |x| = 0.3, where 1 - e would cancel, its Taylor series
 * x (1 - x^2/3 + 2 x^4/15 - ...) to x^11 (the next term is 2e-9 of x there). NaN stays NaN, as
 * tanhf and torch keep it. The same operations lane for lane on either width. */
static inline vf vtanh(vf x) {
    const vf e = vexp(vmul(vmin(vmax(x, vset1(-9.0f)), vset1(9.0f)), vset1(-2.0f)));
    const vf far = vdiv(vsub(vset1(1.0f), e), vadd(vset1(1.0f), e));
    const vf x2 = vmul(x, x);
    vf p = vset1(-1382.0f / 155925.0f);
    p = vfma(p, x2, vset1(62.0f / 2835.0f));
    p = vfma(p, x2, vset1(-17.0f / 315.0f));
    p = vfma(p, x2, vset1(2.0f / 15.0f));
    p = vfma(p, x2, vset1(-1.0f / 3.0f));
    const vf near = vfma(vmul(x, x2), p, x);
    return vkeep_nan(x, vblend_below(x2, 0.09f, near, far));
}
#endif

#endif
