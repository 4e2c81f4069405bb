/* Attention straight from the paged KV cache (float32 or bfloat16, CPU), for decode rows (one query
 * each) and prefill chunks (many) alike.
 *
 * Each row's new keys and values are written into their cache slots first (write_kv). Then each
 * (row, kv head, tile of queries) attends over the row's context block by block, reading keys and
 * values where they lie in the cache: no gathered copy, no mask, and no work for positions a
 * query cannot see (a causal prefill computes half the scores a masked one would). The G query
 * heads that share a kv head are done together, so each key and value is read once for all of
 * them; the queries of a tile share the block while it is in the L1 cache. Softmax is the
 * streaming kind: a running max and sum per query head, the accumulator rescaled once per block.
 *
 * A query's arithmetic does not depend on anything but its own position: it visits the runs of
 * its context in the same order (from its first visible position to the end of that block, whole
 * blocks, its own position last), with the same operations, whether it is a decode row or one
 * query of a prefill chunk of any length, whatever the batch. So a token's attention gives the
 * same bits in a prefill, a chunked prefill or a decode step: a stream recomputed after a
 * restart continues exactly (with the per-row linear, norm, rotation and silu kernels).
 *
 * bfloat16 caches with common geometries are kept in a layout made for vdpbf16ps (the "pairs"
 * layout, below) and read by their own kernel: a 2,048-token SmolLM2 prefill's attention runs at
 * 160-165 GMAC/s on two Zen 5 cores (their measured peak: 231) where the float32-FMA loops ran
 * ~53.
 *
 * Built by worker/kernels/cpu.py with the system C compiler (-O3 -march=native -fopenmp, no
 * reassociation: a sum's order is part of the promise above; no -ffinite-math: -INFINITY is used).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_GROUP 16      /* query heads per kv head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 128     /* tokens per KV block */
#define TILE_HEADS 32     /* query heads (queries x group) a tile holds */

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_BF16_DOT_ATTENTION 1
#else
#define HAVE_BF16_DOT_ATTENTION 0
#endif

/* The cache's layouts. Blocks stay whole in either (block b is elements [b * block_size * kv_heads
 * * head_dim, ...)): swapping, copying and sharing blocks need not know.
 *
 * "Keys by dim" (every cache but the one below): per block and kv head, the keys as
 * [dim][position] (a position's dims block_size elements apart), so that a vector holds one dim
 * of VL consecutive positions and a query's scores for them are VL lanes of fused multiply-adds
 * with no reduction; values as the model gives them, [slot][kv head][dim].
 *
 * "Pairs" (AVX512-BF16, bfloat16, head_dim a multiple of 32, blocks a multiple of 16 tokens): each
 * block holds, per kv head, chunks of 16 positions laid out for vdpbf16ps:
 *
 *     keys     [dim pair d][position i][2]   the two dims of pair d of the chunk's 16 positions
 *     values   [position pair j][dims c][16][2]   dim 16 c + l of positions 2j and 2j + 1
 *
 * so a chunk's 16 scores take head_dim / 2 loads and dot instructions with no transposition,
 * for a decode row as for a prefill chunk. */
enum { LAYOUT_KEYS_BY_DIM = 1, LAYOUT_PAIRS = 2 };

static inline int pairs_layout(const int bf16, int head_dim, int block_size) {
    return HAVE_BF16_DOT_ATTENTION && bf16 && head_dim % 32 == 0 && head_dim <= MAX_HEAD_DIM && block_size % 16 == 0;
}

/* A cache of cache_size-byte elements (4 float32, 2 bfloat16) read by queries of query_size bytes:
 * the pairs layout only where both are bfloat16 (vdpbf16ps multiplies bfloat16 by bfloat16). */
int kv_layout(int cache_size, int query_size, int head_dim, int block_size) {
    return pairs_layout(cache_size == 2 && query_size == 2, head_dim, block_size) ? LAYOUT_PAIRS : LAYOUT_KEYS_BY_DIM;
}

/* Where dim 0 of kv head h's keys at position `at` of a block lies in the keys-by-dim layout
 * (dim d: d * block_size further). */
static inline int64_t key_column(int64_t block, int at, int h, int kv_heads, int head_dim, int block_size) {
    return (block * kv_heads + h) * head_dim * block_size + at;
}

/* Element i of a row of row_size-byte values, as a cache of cache_size-byte values holds it
 * (a float32 row into a bfloat16 cache: rounded to nearest even, as torch rounds). */
static inline void put(void *cache, int64_t at, const void *row, int64_t i, int row_size, int cache_size) {
    if (cache_size == 4)
        ((float *)cache)[at] = ((const float *)row)[i];
    else if (row_size == 2)
        ((uint16_t *)cache)[at] = ((const uint16_t *)row)[i];
    else
        ((uint16_t *)cache)[at] = f32_to_bf16(((const float *)row)[i]);
}

/* One slot's keys and values [kv_heads][head_dim] (row_size-byte values) into a cache of
 * cache_size-byte values, in its layout. A float32 row goes into either cache; a bfloat16 row
 * only into a bfloat16 one. */
void store_kv(const void *k_row, const void *v_row, void *k_cache, void *v_cache, int64_t slot, int kv_heads,
              int head_dim, int block_size, int row_size, int cache_size) {
    const int64_t width = (int64_t)kv_heads * head_dim;
    const int64_t block = slot / block_size, p = slot % block_size;
    if (kv_layout(cache_size, row_size, head_dim, block_size) == LAYOUT_KEYS_BY_DIM) {
        if (row_size == cache_size)
            memcpy((char *)v_cache + slot * width * cache_size, v_row, width * cache_size);
        else
            for (int64_t i = 0; i < width; i++) put(v_cache, slot * width + i, v_row, i, row_size, cache_size);
        for (int h = 0; h < kv_heads; h++) {
            const int64_t at = key_column(block, (int)p, h, kv_heads, head_dim, block_size);
            for (int d = 0; d < head_dim; d++)
                put(k_cache, at + (int64_t)d * block_size, k_row, h * head_dim + d, row_size, cache_size);
        }
        return;
    }
    const int64_t i = p % 16, dims = head_dim / 16;
    const uint16_t *k = k_row, *v = v_row;
    for (int h = 0; h < kv_heads; h++) {
        const int64_t chunk = ((block * kv_heads + h) * block_size + (p - i)) * head_dim;
        uint16_t *kc = (uint16_t *)k_cache + chunk, *vc = (uint16_t *)v_cache + chunk;
        for (int d = 0; d < head_dim; d++) {
            kc[((d / 2) * 16 + i) * 2 + d % 2] = k[h * head_dim + d];
            vc[(((i / 2) * dims + d / 16) * 16 + d % 16) * 2 + i % 2] = v[h * head_dim + d];
        }
    }
}

/* Strides are in elements of row_size bytes (4: float32, 2: bfloat16). A negative slot is
 * skipped (a padding row). */
void write_kv(const char *k_new, const char *v_new, int64_t k_stride, int64_t v_stride, char *k_cache,
              char *v_cache, const int64_t *slots, int num_rows, int kv_heads, int head_dim, int block_size,
              int row_size, int cache_size) {
    for (int b = 0; b < num_rows; b++) {
        if (slots[b] < 0) continue;
        store_kv(k_new + b * k_stride * row_size, v_new + b * v_stride * row_size, k_cache, v_cache, slots[b],
                 kv_heads, head_dim, block_size, row_size, cache_size);
    }
}

/* Element i of a float32 (bf16 == 0) or bfloat16 (bf16 == 1) array, as a float. */
static inline float load(const void *base, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* Where the rows' queries are: row r's queries are the last lengths[r] positions before ends[r]
 * (lengths NULL: one each), at flat tokens first_tokens[r] onwards (NULL: token r); query j sees
 * from max(first_positions[r], position - window + 1) (window 0: first_positions[r]) to itself. */
typedef struct {
    const int32_t *block_table;
    int max_blocks;
    const int32_t *ends, *lengths, *first_tokens, *first_positions;
    int window;
    float softcap; /* > 0: scores soft-capped, cap tanh(score / cap), before the softmax (Gemma 2) */
} Rows;

static inline int row_length(const Rows *rows, int r) { return rows->lengths ? rows->lengths[r] : 1; }

static inline int first_visible(const Rows *rows, int r, int position) {
    const int first = rows->first_positions[r];
    if (rows->window > 0 && position - rows->window + 1 > first) return position - rows->window + 1;
    return first;
}

/* The work items of a call: (row, kv head, tile of `per_tile` queries), tiles of a row counted
 * from its last (the costliest under causal masking first, for the dynamic schedule). */
static inline void item_of(const Rows *rows, int num_rows, int kv_heads, int per_tile, int item, int *r, int *h,
                           int *tile) {
    for (int row = 0; row < num_rows; row++) {
        const int tiles = (row_length(rows, row) + per_tile - 1) / per_tile;
        if (item < tiles * kv_heads) {
            *r = row;
            *h = item % kv_heads;
            *tile = tiles - 1 - item / kv_heads;
            return;
        }
        item -= tiles * kv_heads;
    }
    *r = -1;
}

static inline int count_items(const Rows *rows, int num_rows, int kv_heads, int per_tile) {
    int items = 0;
    for (int row = 0; row < num_rows; row++) items += (row_length(rows, row) + per_tile - 1) / per_tile * kv_heads;
    return items;
}

/* A tile's queries: their positions, what each sees from, their flat tokens, and the span of
 * positions any of them sees ([lo, hi)). */
typedef struct {
    int nq, lo, hi;
    int position[TILE_HEADS], first[TILE_HEADS];
    int64_t token[TILE_HEADS];
} Tile;

static inline void tile_of(const Rows *rows, int r, int tile, int per_tile, Tile *t) {
    const int length = row_length(rows, r), j0 = tile * per_tile;
    t->nq = length - j0 < per_tile ? length - j0 : per_tile;
    t->lo = 1 << 30;
    t->hi = 0;
    for (int i = 0; i < t->nq; i++) {
        t->position[i] = rows->ends[r] - length + j0 + i;
        t->first[i] = first_visible(rows, r, t->position[i]);
        t->token[i] = (rows->first_tokens ? rows->first_tokens[r] : r) + j0 + i;
        t->lo = t->first[i] < t->lo ? t->first[i] : t->lo;
        t->hi = t->position[i] + 1 > t->hi ? t->position[i] + 1 : t->hi;
    }
}

/* Work item `item`'s kv head and tile of queries; returns its row's block table. */
static inline const int32_t *tile_at(const Rows *rows, int num_rows, int kv_heads, int per_tile, int item, int *h,
                                     Tile *tl) {
    int r, tile;
    item_of(rows, num_rows, kv_heads, per_tile, item, &r, h, &tile);
    tile_of(rows, r, tile, per_tile, tl);
    return rows->block_table + (int64_t)r * rows->max_blocks;
}

/* Query i's run in the block starting at position start: how many positions (0: none) and the
 * element offset of the first one's key (or value) for kv head h. */
static inline int run_in_block(const Tile *t, int i, int start, int block_size, int64_t block_base,
                               int64_t slot_width, int64_t head_offset, int64_t *kv_base) {
    const int a = t->first[i] > start ? t->first[i] : start;
    const int b = t->position[i] + 1 < start + block_size ? t->position[i] + 1 : start + block_size;
    *kv_base = (block_base + a - start) * slot_width + head_offset;
    return a < b ? b - a : 0;
}

/* ------------------------------------------------------------------ plain loops */

/* q and out are float32 or bfloat16 (bf16), and so are the caches (kv16); scores, softmax and the
 * accumulators are float32 either way. Inlined with bf16 and kv16 constants: each combination
 * compiles to its own loops. */
static inline __attribute__((always_inline)) void attend_rows(
        const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, const Rows *rows, void *out,
        int num_rows, int num_heads, int kv_heads, int head_dim, int block_size, float scale, const int bf16,
        const int kv16) {
    const int group = num_heads / kv_heads;
    const int per_tile = TILE_HEADS / group > 0 ? TILE_HEADS / group : 1;
    const int64_t slot_width = (int64_t)kv_heads * head_dim;
    const int items = count_items(rows, num_rows, kv_heads, per_tile);
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < items; item++) {
        int h;
        Tile tl;
        const int32_t *table = tile_at(rows, num_rows, kv_heads, per_tile, item, &h, &tl);
        const int nq = tl.nq;
        float acc[TILE_HEADS][MAX_HEAD_DIM], qs[TILE_HEADS][MAX_HEAD_DIM];
        float running_max[TILE_HEADS], running_sum[TILE_HEADS], scores[MAX_GROUP][MAX_BLOCK];
        for (int t = 0; t < nq; t++) {
            for (int g = 0; g < group; g++) {
                const int64_t qg = tl.token[t] * q_stride + (int64_t)(h * group + g) * head_dim;
                for (int d = 0; d < head_dim; d++) {
                    qs[t * group + g][d] = load(q, qg + d, bf16) * scale;
                    acc[t * group + g][d] = 0.0f;
                }
                running_max[t * group + g] = -INFINITY;
                running_sum[t * group + g] = 0.0f;
            }
        }
        for (int start = tl.lo - tl.lo % block_size; start < tl.hi; start += block_size) {
            const int64_t block_base = (int64_t)table[start / block_size] * block_size;
            for (int t = 0; t < nq; t++) {
                int64_t kv_base;
                const int n = run_in_block(&tl, t, start, block_size, block_base, slot_width, (int64_t)h * head_dim,
                                           &kv_base);
                if (n == 0) continue;
                const int a = tl.first[t] > start ? tl.first[t] - start : 0;
                const int64_t keys = key_column(table[start / block_size], a, h, kv_heads, head_dim, block_size);
                for (int g = 0; g < group; g++) {
                    const int s_ = t * group + g;
                    float block_max = running_max[s_];
                    for (int i = 0; i < n; i++) {
                        float s = 0.0f;
                        for (int d = 0; d < head_dim; d++)
                            s += qs[s_][d] * load(k_cache, keys + i + (int64_t)d * block_size, kv16);
                        if (rows->softcap > 0.0f) s = rows->softcap * tanhf(s / rows->softcap);
                        scores[g][i] = s;
                        if (s > block_max) block_max = s;
                    }
                    const float rescale = expf(running_max[s_] - block_max);
                    running_sum[s_] *= rescale;
                    for (int d = 0; d < head_dim; d++) acc[s_][d] *= rescale;
                    running_max[s_] = block_max;
                    for (int i = 0; i < n; i++) {
                        const float p = expf(scores[g][i] - block_max);
                        running_sum[s_] += p;
                        const int64_t v = kv_base + i * slot_width;
                        for (int d = 0; d < head_dim; d++) acc[s_][d] += p * load(v_cache, v + d, kv16);
                    }
                }
            }
        }
        for (int t = 0; t < nq; t++) {
            for (int g = 0; g < group; g++) {
                const int s_ = t * group + g;
                const int64_t o = (tl.token[t] * num_heads + h * group + g) * head_dim;
                const float inv = 1.0f / running_sum[s_];
                for (int d = 0; d < head_dim; d++) {
                    if (bf16)
                        ((uint16_t *)out)[o + d] = f32_to_bf16(acc[s_][d] * inv);
                    else
                        ((float *)out)[o + d] = acc[s_][d] * inv;
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ vectors (AVX-512 or AVX2) */

#include "simd.h"
#ifdef VL

/* The same attention over vf (simd.h: 16 lanes with AVX-512, 8 with AVX2), a kv head's tile of
 * queries block by block, as small matrix products that keep their accumulators in registers:
 *
 *   scores  up to SCORE_SET query heads by a 16-position chunk, one chain of head_dim fused
 *           multiply-adds per lane (a position), over the keys-by-dim layout: a dim of the chunk's
 *           positions is one load shared by the set's heads, each head's query value one
 *           broadcast; no reduction.
 *   softmax per head over the block: a running max and sum, the accumulator rescaled when the max
 *           grows, e^(s - max) VL lanes at a time (vexp), positions the head does not see set to 0.
 *   values  up to 4 heads by a few dim vectors (VALUE_REGISTERS accumulators), one chain per
 *           lane (a dim) over the block's positions in order: a value vector is one load shared
 *           by the set's heads, a probability one broadcast.
 *
 * Every position the tile sees in the block is taken by every head of the tile; a head's
 * positions outside its own run get probability 0, which adds exactly nothing (0 times a finite
 * value, to an accumulator that starts at +0). So a head's arithmetic is that of its own
 * position alone, whatever the tile, and a lane's is the same on either vector width: float32
 * attention gives the same bits in a prefill, a chunk or a decode step, and on AVX2 as on
 * AVX-512. As AVX2, a 4,096-token SmolLM2 prefill's attention took 7.5 s, about 60% of two cores'
 * FMA peak, against 9.7 s for the loops this replaced (dot products reduced four at a time, the
 * accumulators in memory); decode, bound by reading the cache, is unchanged. */
#define KEY_CHUNK 16                     /* positions a score chain set covers */
#define CHUNK_VECTORS (KEY_CHUNK / VL)   /* vectors per chunk: 2 on AVX2, 1 on AVX-512 */
#define SCORE_SET (8 / CHUNK_VECTORS)    /* heads per score pass: 8 accumulators */
#define VALUE_REGISTERS (VL == 16 ? 16 : 8)

/* The sum of 16 floats in one fixed order, in 256-bit instructions on either set. */
static inline float sum16(const float *p) {
    const __m256 t = _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}

/* n heads' scores (query rows qs[j], scaled) for chunks c_lo .. c_hi - 1 of a block's keys
 * (keys: dim 0 of the block's position 0, in the keys-by-dim layout) into scores[j]. */
static inline __attribute__((always_inline)) void score_heads(const float *const *qs, float *const *scores,
                                                              const void *k_cache, int64_t keys, int head_dim,
                                                              int block_size, int c_lo, int c_hi, const int n,
                                                              const int bf16) {
    for (int c = c_lo; c < c_hi; c++) {
        vf s[SCORE_SET][CHUNK_VECTORS];
        for (int j = 0; j < n; j++)
            for (int v = 0; v < CHUNK_VECTORS; v++) s[j][v] = vzero();
        for (int d = 0; d < head_dim; d++) {
            vf k[CHUNK_VECTORS];
            for (int v = 0; v < CHUNK_VECTORS; v++)
                k[v] = vload(k_cache, keys + (int64_t)d * block_size + KEY_CHUNK * c + VL * v, bf16);
            for (int j = 0; j < n; j++) {
                const vf qd = vset1(qs[j][d]);
                for (int v = 0; v < CHUNK_VECTORS; v++) s[j][v] = vfma(qd, k[v], s[j][v]);
            }
        }
        for (int j = 0; j < n; j++)
            for (int v = 0; v < CHUNK_VECTORS; v++) vstore(scores[j], KEY_CHUNK * c + VL * v, s[j][v], 0);
    }
}

static inline __attribute__((always_inline)) void score_set(const float *const *qs, float *const *scores,
                                                            const void *k_cache, int64_t keys, int head_dim,
                                                            int block_size, int c_lo, int c_hi, int n, const int bf16) {
    switch (n) {
#define SCORE_CASE(k) \
    case k: score_heads(qs, scores, k_cache, keys, head_dim, block_size, c_lo, c_hi, k, bf16); break
        SCORE_CASE(1); SCORE_CASE(2); SCORE_CASE(3);
#if SCORE_SET > 4
        SCORE_CASE(4); SCORE_CASE(5); SCORE_CASE(6); SCORE_CASE(7);
#endif
        default: score_heads(qs, scores, k_cache, keys, head_dim, block_size, c_lo, c_hi, SCORE_SET, bf16);
#undef SCORE_CASE
    }
}

/* n heads' accumulators acc[j] (dim vectors c0 .. c0 + dims - 1) += p[j][i] x value i, for
 * positions i = lo .. hi - 1 in order (values: position 0's row, slot_width apart). */
static inline __attribute__((always_inline)) void value_heads(float *const *acc, const float *const *p,
                                                              const void *v_cache, int64_t values, int64_t slot_width,
                                                              int lo, int hi, int c0, const int n, const int dims,
                                                              const int bf16) {
    vf a[4][VALUE_REGISTERS];
    for (int j = 0; j < n; j++)
        for (int c = 0; c < dims; c++) a[j][c] = vloadu(acc[j] + VL * (c0 + c));
    for (int i = lo; i < hi; i++) {
        vf v[VALUE_REGISTERS];
        for (int c = 0; c < dims; c++) v[c] = vload(v_cache, values + i * slot_width + VL * (c0 + c), bf16);
        for (int j = 0; j < n; j++) {
            const vf pj = vset1(p[j][i]);
            for (int c = 0; c < dims; c++) a[j][c] = vfma(pj, v[c], a[j][c]);
        }
    }
    for (int j = 0; j < n; j++)
        for (int c = 0; c < dims; c++) vstore(acc[j], VL * (c0 + c), a[j][c], 0);
}

/* value_heads over all `chunks` dim vectors, `dims` at a time (a constant dividing chunks), for
 * n heads (at most VALUE_REGISTERS / dims, and 4). */
static inline __attribute__((always_inline)) void value_set(float *const *acc, const float *const *p,
                                                            const void *v_cache, int64_t values, int64_t slot_width,
                                                            int lo, int hi, int n, const int chunks, const int dims,
                                                            const int bf16) {
    for (int c0 = 0; c0 < chunks; c0 += dims) {
        switch (n) {
            case 1: value_heads(acc, p, v_cache, values, slot_width, lo, hi, c0, 1, dims, bf16); break;
            case 2: value_heads(acc, p, v_cache, values, slot_width, lo, hi, c0, 2, dims, bf16); break;
            case 3: value_heads(acc, p, v_cache, values, slot_width, lo, hi, c0, 3, dims, bf16); break;
            default: value_heads(acc, p, v_cache, values, slot_width, lo, hi, c0, 4, dims, bf16); break;
        }
    }
}

/* dims (a constant) for value_set: the most dim vectors that divide chunks and leave room for
 * two heads' accumulators. */
static inline int value_dims(int chunks) {
    for (int dims = VALUE_REGISTERS / 2; dims > 1; dims /= 2)
        if (chunks % dims == 0) return dims;
    return 1;
}

static inline __attribute__((always_inline)) void attend_rows_vec(
        const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, const Rows *rows, void *out,
        int num_rows, int num_heads, int kv_heads, int head_dim, int block_size, float scale, const int bf16,
        const int kv16, const int chunks, const int dims) {
    const int group = num_heads / kv_heads;
    const int per_tile = TILE_HEADS / group > 0 ? TILE_HEADS / group : 1;
    const int64_t slot_width = (int64_t)kv_heads * head_dim;
    const int items = count_items(rows, num_rows, kv_heads, per_tile);
    const int value_set_size = VALUE_REGISTERS / dims < 4 ? VALUE_REGISTERS / dims : 4;
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < items; item++) {
        int h;
        Tile tl;
        const int32_t *table = tile_at(rows, num_rows, kv_heads, per_tile, item, &h, &tl);
        const int nq = tl.nq;
        float qs[TILE_HEADS][MAX_HEAD_DIM] __attribute__((aligned(64)));
        float acc[TILE_HEADS][MAX_HEAD_DIM] __attribute__((aligned(64)));
        float scores[TILE_HEADS][MAX_BLOCK] __attribute__((aligned(64)));
        float running_max[TILE_HEADS], running_sum[TILE_HEADS];
        for (int t = 0; t < nq; t++) {
            for (int g = 0; g < group; g++) {
                const int s_ = t * group + g;
                const int64_t qg = tl.token[t] * q_stride + (int64_t)(h * group + g) * head_dim;
                for (int c = 0; c < chunks; c++) {
                    vstore(qs[s_], VL * c, vmul(vload(q, qg + VL * c, bf16), vset1(scale)), 0);
                    vstore(acc[s_], VL * c, vzero(), 0);
                }
                running_max[s_] = -INFINITY;
                running_sum[s_] = 0.0f;
            }
        }
        for (int start = tl.lo - tl.lo % block_size; start < tl.hi; start += block_size) {
            const int64_t block = table[start / block_size];
            /* each query's run [run_lo, run_hi) in the block, and their union [lo, hi) */
            int run_lo[TILE_HEADS], run_hi[TILE_HEADS], heads[TILE_HEADS], active = 0, lo = block_size, hi = 0;
            for (int t = 0; t < nq; t++) {
                const int a = tl.first[t] > start ? tl.first[t] - start : 0;
                const int b = tl.position[t] + 1 < start + block_size ? tl.position[t] + 1 - start : block_size;
                if (a >= b) continue;
                for (int g = 0; g < group; g++) {
                    run_lo[active] = a;
                    run_hi[active] = b;
                    heads[active++] = t * group + g;
                }
                lo = a < lo ? a : lo;
                hi = b > hi ? b : hi;
            }
            if (active == 0) continue;
            const int c_lo = lo / KEY_CHUNK, c_hi = (hi + KEY_CHUNK - 1) / KEY_CHUNK;
            const int64_t keys = key_column(block, 0, h, kv_heads, head_dim, block_size);
            for (int j0 = 0; j0 < active; j0 += SCORE_SET) {
                const int n = active - j0 < SCORE_SET ? active - j0 : SCORE_SET;
                const float *qp[SCORE_SET];
                float *sp[SCORE_SET];
                for (int j = 0; j < n; j++) {
                    qp[j] = qs[heads[j0 + j]];
                    sp[j] = scores[heads[j0 + j]];
                }
                score_set(qp, sp, k_cache, keys, head_dim, block_size, c_lo, c_hi, n, kv16);
            }
            if (rows->softcap > 0.0f) {
                const vf cap = vset1(rows->softcap), inv_cap = vset1(1.0f / rows->softcap);
                for (int j = 0; j < active; j++)
                    for (int at = KEY_CHUNK * c_lo; at < KEY_CHUNK * c_hi; at += VL)
                        vstore(scores[heads[j]], at, vmul(cap, vtanh(vmul(vloadu(scores[heads[j]] + at), inv_cap))), 0);
            }
            for (int j = 0; j < active; j++) {
                const int s_ = heads[j], a = run_lo[j], b = run_hi[j];
                float *sc = scores[s_];
                vf top = vset1(-INFINITY); /* max is exact in any order */
                for (int at = a - a % VL; at < b; at += VL) top = vmax(top, vkeep_range(vloadu(sc + at), a - at, b - at, -INFINITY));
                const float block_max = vreduce_max(top);
                if (block_max > running_max[s_]) {
                    const float rescale = expf(running_max[s_] - block_max);
                    running_sum[s_] *= rescale;
                    for (int c = 0; c < chunks; c++) vstore(acc[s_], VL * c, vmul(vloadu(acc[s_] + VL * c), vset1(rescale)), 0);
                    running_max[s_] = block_max;
                }
                const vf top_max = vset1(running_max[s_]);
                for (int c = c_lo; c < c_hi; c++) {
                    for (int v = 0; v < CHUNK_VECTORS; v++) {
                        const int at = KEY_CHUNK * c + VL * v;
                        vstore(sc, at, vkeep_range(vexp(vsub(vloadu(sc + at), top_max)), a - at, b - at, 0.0f), 0);
                    }
                    running_sum[s_] += sum16(sc + KEY_CHUNK * c);
                }
            }
            const int64_t values = block * block_size * slot_width + (int64_t)h * head_dim;
            for (int j0 = 0; j0 < active; j0 += value_set_size) {
                const int n = active - j0 < value_set_size ? active - j0 : value_set_size;
                float *ap[4];
                const float *pp[4];
                for (int j = 0; j < n; j++) {
                    ap[j] = acc[heads[j0 + j]];
                    pp[j] = scores[heads[j0 + j]];
                }
                value_set(ap, pp, v_cache, values, slot_width, lo, hi, n, chunks, dims, kv16);
            }
        }
        for (int t = 0; t < nq; t++) {
            for (int g = 0; g < group; g++) {
                const int s_ = t * group + g;
                const int64_t o = (tl.token[t] * num_heads + h * group + g) * head_dim;
                const vf inv = vset1(1.0f / running_sum[s_]);
                for (int c = 0; c < chunks; c++) vstore(out, o + VL * c, vmul(vloadu(acc[s_] + VL * c), inv), bf16);
            }
        }
    }
}
#define HAVE_VEC_ATTENTION 1
#else
#define HAVE_VEC_ATTENTION 0
#endif

/* ------------------------------------------------------------------ bfloat16 dot products */

#if HAVE_BF16_DOT_ATTENTION
#define KEYS 16            /* positions per chunk: one score per lane */
#define SUBS 4             /* chunks per span */
#define SPAN (KEYS * SUBS) /* positions per softmax update (a running max, a rescale, a sum) */

/* Query heads a pass takes together: as many as keep their PV accumulators (heads x head_dim / 16
 * vectors) within 16 of the 32 registers. */
#define HEAD_SET_VECTORS 16

/* 32 bfloat16 loaded as vdpbf16ps takes them, from any address (a cast of _mm512_loadu_si512's
 * result made GCC 12 store and reload every vector through the stack). */
typedef short bf16x32_unaligned __attribute__((__vector_size__(64), __may_alias__, __aligned__(1)));
static inline __m512bh load_bf16x32(const void *p) { return (__m512bh) * (const bf16x32_unaligned *)p; }

/* The softmax numerators of a chunk's raw scores s: e^((s - max) scale) as 2^(s c - max c), c =
 * scale log2(e) (max_c = max c): an integer n and f in [-1/2, 1/2], 2^f by its Taylor series in
 * f ln 2 to degree 5 (relative error ~3e-6: each is rounded to bfloat16, 4e-3, right after), then
 * scaled by 2^n. Lanes whose score is -infinity come out NaN; the caller zeroes them. */
static inline __m512 softmax_numerators(__m512 s, __m512 c, __m512 max_c) {
    const __m512 t = _mm512_fmsub_ps(s, c, max_c);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    /* sum_k (f ln 2)^k / k!, its coefficients ln(2)^k / k! */
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* A span's chunks as one query sees them: its chunks sub_a .. sub_b, and in each the positions
 * [lo, hi) it sees (mask: those lanes). full: all 64 positions (then constants). */
typedef struct {
    int sub_a, sub_b;
    int run_lo[SUBS], run_hi[SUBS];
    __mmask16 mask[SUBS];
} SpanView;

/* n query heads (n a constant) over one span: head g's query pairs at qs[g], its accumulator,
 * running max and sum at index slots[g] of acc, running_max and running_sum. The heads share the
 * span's view: one query's heads, or (full spans) heads of several queries.
 *
 * A head's score for a chunk of 16 positions is one chain of head_dim / 2 dot instructions over
 * the chunk's dim pairs, the query's pair broadcast; the n heads (and, over a full span, the four
 * chunks) are independent chains, interleaved, each key vector loaded once for all of them. The
 * running max, the rescale and the sum are updated once per span. Probabilities are rounded to
 * bfloat16 (as FlashAttention rounds P before its PV product; the softmax sum adds the same
 * rounded values), and each head's output gains the span in one chain per 16 dims over the
 * position pairs in order, each value vector loaded once for the n heads. A head's arithmetic is
 * the same in the full-span path as in the general one. */
static inline __attribute__((always_inline)) void span_heads(
        const int32_t *const *qs, const int *slots, const __m512i *const *keys, const __m512i *const *values,
        const SpanView *view, float scale, float softcap, __m512 (*acc)[MAX_HEAD_DIM / 16], float *running_max,
        float *running_sum, const int n, const int chunks, const int full) {
    const int pairs = chunks * 8;
    const int sub_a = full ? 0 : view->sub_a, sub_b = full ? SUBS - 1 : view->sub_b;
    const float scale_log2e = scale * 1.44269504088896341f; /* running_max[] holds raw scores */
    __m512 scores[HEAD_SET_VECTORS][SUBS];
    for (int g = 0; g < n; g++)
        for (int sub = 0; sub < SUBS; sub++) scores[g][sub] = _mm512_setzero_ps();
    if (full) {
        for (int d = 0; d < pairs; d++) {
            __m512bh qd[HEAD_SET_VECTORS];
            for (int g = 0; g < n; g++) qd[g] = (__m512bh)_mm512_set1_epi32(qs[g][d]);
            for (int sub = 0; sub < SUBS; sub++) {
                const __m512bh kd = load_bf16x32(keys[sub] + d);
                for (int g = 0; g < n; g++) scores[g][sub] = _mm512_dpbf16_ps(scores[g][sub], kd, qd[g]);
            }
        }
    } else {
        for (int sub = sub_a; sub <= sub_b; sub++) {
            for (int d = 0; d < pairs; d++) {
                const __m512bh kd = load_bf16x32(keys[sub] + d);
                for (int g = 0; g < n; g++)
                    scores[g][sub] = _mm512_dpbf16_ps(scores[g][sub], kd, (__m512bh)_mm512_set1_epi32(qs[g][d]));
            }
        }
    }
    if (softcap > 0.0f) { /* on raw scores: (cap / scale) tanh(raw scale / cap), whose scaled value is capped */
        const __m512 to = _mm512_set1_ps(scale / softcap), back = _mm512_set1_ps(softcap / scale);
        for (int g = 0; g < n; g++)
            for (int sub = sub_a; sub <= sub_b; sub++)
                scores[g][sub] = _mm512_mul_ps(back, vtanh(_mm512_mul_ps(scores[g][sub], to)));
    }
    int32_t p_pairs[HEAD_SET_VECTORS][SUBS][KEYS / 2];
    for (int g = 0; g < n; g++) {
        if (!full) /* the max is taken over raw scores: scale > 0 */
            for (int sub = sub_a; sub <= sub_b; sub++)
                scores[g][sub] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), view->mask[sub], scores[g][sub]);
        __m512 top = scores[g][sub_a];
        for (int sub = sub_a + 1; sub <= sub_b; sub++) top = _mm512_max_ps(top, scores[g][sub]);
        const float span_max = _mm512_reduce_max_ps(top);
        const int at = slots[g];
        if (span_max > running_max[at]) {
            const float rescale = exp2f((running_max[at] - span_max) * scale_log2e);
            running_sum[at] *= rescale;
            for (int c = 0; c < chunks; c++) acc[at][c] = _mm512_mul_ps(acc[at][c], _mm512_set1_ps(rescale));
            running_max[at] = span_max;
        }
        __m512 total = _mm512_setzero_ps();
        for (int sub = sub_a; sub <= sub_b; sub++) {
            __m512 p = softmax_numerators(scores[g][sub], _mm512_set1_ps(scale_log2e),
                                          _mm512_set1_ps(running_max[at] * scale_log2e));
            if (!full) p = _mm512_maskz_mov_ps(view->mask[sub], p);
            const __m256bh rounded = _mm512_cvtneps_pbh(p);
            total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)rounded), 16)));
            _mm256_storeu_si256((__m256i *)p_pairs[g][sub], (__m256i)rounded);
        }
        running_sum[at] += _mm512_reduce_add_ps(total);
    }
    __m512 part[HEAD_SET_VECTORS][MAX_HEAD_DIM / 16];
    for (int g = 0; g < n; g++)
        for (int c = 0; c < chunks; c++) part[g][c] = _mm512_setzero_ps();
    for (int sub = sub_a; sub <= sub_b; sub++) {
        const int lo = full ? 0 : view->run_lo[sub], hi = full ? KEYS : view->run_hi[sub];
        for (int j = lo / 2; j <= (hi - 1) / 2; j++) {
            /* a pair half outside the run: that position's values may be another request's (or
             * NaN); its probability is 0, its value zeroed too */
            const __m512i keep = _mm512_set1_epi32((int)((2 * j < lo ? 0xFFFF0000u : 0xFFFFFFFFu) &
                                                         (2 * j + 1 >= hi ? 0x0000FFFFu : 0xFFFFFFFFu)));
            for (int c = 0; c < chunks; c++) {
                const __m512i *at = values[sub] + j * chunks + c;
                const __m512bh vpair = full ? load_bf16x32(at) : (__m512bh)_mm512_and_si512(_mm512_loadu_si512(at), keep);
                for (int g = 0; g < n; g++)
                    part[g][c] = _mm512_dpbf16_ps(part[g][c], vpair, (__m512bh)_mm512_set1_epi32(p_pairs[g][sub][j]));
            }
        }
    }
    for (int g = 0; g < n; g++)
        for (int c = 0; c < chunks; c++) acc[slots[g]][c] = _mm512_add_ps(acc[slots[g]][c], part[g][c]);
}

/* span_heads for n query heads (slots), n a runtime count up to HEAD_SET_VECTORS / chunks, each
 * count compiled with its constant. */
static inline __attribute__((always_inline)) void span_head_set(
        const int32_t *const *qs, const int *slots, const __m512i *const *keys, const __m512i *const *values,
        const SpanView *view, float scale, float softcap, __m512 (*acc)[MAX_HEAD_DIM / 16], float *running_max,
        float *running_sum, int n, const int chunks, const int full) {
    switch (n) {
        case 1: span_heads(qs, slots, keys, values, view, scale, softcap, acc, running_max, running_sum, 1, chunks, full); break;
        case 2: span_heads(qs, slots, keys, values, view, scale, softcap, acc, running_max, running_sum, 2, chunks, full); break;
        case 3: span_heads(qs, slots, keys, values, view, scale, softcap, acc, running_max, running_sum, 3, chunks, full); break;
        default: span_heads(qs, slots, keys, values, view, scale, softcap, acc, running_max, running_sum, 4, chunks, full); break;
    }
}

/* bfloat16 attention over a cache in the pairs layout, with vdpbf16ps (two bfloat16 products
 * summed into each float32 lane): per work item, a kv head's tile of queries, span by span of
 * 64 positions, each query's heads in sets (span_heads). A query's arithmetic depends only on its
 * own position: it takes the chunks of its visible range in order, spans and chunks aligned to
 * absolute positions, each with its own mask, whatever the tile or batch. So decode rows, prefill
 * chunks and recomputes give the same bits, as with the loops above. */
static inline __attribute__((always_inline)) void attend_rows_bf16_dot(
        const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache, const Rows *rows,
        uint16_t *out, int num_rows, int num_heads, int kv_heads, int head_dim, int block_size, float scale,
        const int chunks) {
    const int group = num_heads / kv_heads;
    const int per_tile = TILE_HEADS / group > 0 ? TILE_HEADS / group : 1;
    const int set_size = HEAD_SET_VECTORS / chunks < 4 ? HEAD_SET_VECTORS / chunks : 4;
    const int items = count_items(rows, num_rows, kv_heads, per_tile);
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < items; item++) {
        int h;
        Tile tl;
        const int32_t *table = tile_at(rows, num_rows, kv_heads, per_tile, item, &h, &tl);
        const int nq = tl.nq;
        __m512 acc[TILE_HEADS][MAX_HEAD_DIM / 16];
        float running_max[TILE_HEADS], running_sum[TILE_HEADS];
        for (int i = 0; i < nq * group; i++) {
            for (int c = 0; c < chunks; c++) acc[i][c] = _mm512_setzero_ps();
            running_max[i] = -INFINITY;
            running_sum[i] = 0.0f;
        }
        for (int s0 = tl.lo - tl.lo % SPAN; s0 < tl.hi; s0 += SPAN) {
            const __m512i *keys[SUBS], *values[SUBS];
            for (int sub = 0; sub < SUBS; sub++) {
                const int k0 = s0 + KEYS * sub;
                keys[sub] = values[sub] = 0;
                if (k0 >= tl.hi || k0 + KEYS <= tl.lo) continue;
                const int64_t chunk = (((int64_t)table[k0 / block_size] * kv_heads + h) * block_size + k0 % block_size)
                                      * head_dim;
                keys[sub] = (const __m512i *)(k_cache + chunk);
                values[sub] = (const __m512i *)(v_cache + chunk);
            }
            const int32_t *pending_q[4];
            int pending_slot[4], pending = 0;
            for (int t = 0; t < nq; t++) {
                const int a = tl.first[t] > s0 ? tl.first[t] : s0;
                const int b = tl.position[t] + 1 < s0 + SPAN ? tl.position[t] + 1 : s0 + SPAN;
                if (a >= b) continue;
                const int32_t *qp = (const int32_t *)(q + tl.token[t] * q_stride + (int64_t)h * group * head_dim);
                if (a == s0 && b == s0 + SPAN) { /* whole-span heads join the pending set, whichever query */
                    for (int g = 0; g < group; g++) {
                        pending_q[pending] = qp + g * (head_dim / 2);
                        pending_slot[pending++] = t * group + g;
                        if (pending == set_size) {
                            span_head_set(pending_q, pending_slot, keys, values, 0, scale, rows->softcap, acc, running_max,
                                          running_sum, pending, chunks, 1);
                            pending = 0;
                        }
                    }
                    continue;
                }
                SpanView view;
                view.sub_a = (a - s0) / KEYS;
                view.sub_b = (b - 1 - s0) / KEYS; /* the query's chunks */
                for (int sub = view.sub_a; sub <= view.sub_b; sub++) {
                    const int k0 = s0 + KEYS * sub;
                    view.run_lo[sub] = a > k0 ? a - k0 : 0;
                    view.run_hi[sub] = b < k0 + KEYS ? b - k0 : KEYS;
                    view.mask[sub] = (__mmask16)(((1u << view.run_hi[sub]) - 1) & ~((1u << view.run_lo[sub]) - 1));
                }
                for (int g0 = 0; g0 < group; g0 += set_size) {
                    const int n = group - g0 < set_size ? group - g0 : set_size;
                    const int32_t *qs[4];
                    int slots[4];
                    for (int i = 0; i < n; i++) {
                        qs[i] = qp + (g0 + i) * (head_dim / 2);
                        slots[i] = t * group + g0 + i;
                    }
                    span_head_set(qs, slots, keys, values, &view, scale, rows->softcap, acc, running_max, running_sum, n, chunks, 0);
                }
            }
            if (pending > 0)
                span_head_set(pending_q, pending_slot, keys, values, 0, scale, rows->softcap, acc, running_max, running_sum, pending,
                              chunks, 1);
        }
        for (int t = 0; t < nq; t++) {
            for (int g = 0; g < group; g++) {
                const int s_ = t * group + g;
                const int64_t o = (tl.token[t] * num_heads + h * group + g) * head_dim;
                const __m512 inv = _mm512_set1_ps(1.0f / running_sum[s_]);
                for (int c = 0; c < chunks; c++) store16(out, o + 16 * c, _mm512_mul_ps(acc[s_][c], inv), 1);
            }
        }
    }
}
#endif

/* The vector path where it applies (common head sizes with constant trip counts), else the plain
 * loops; inlined into the entry points with bf16 (queries, out) and kv16 (the caches) constants. */
static inline __attribute__((always_inline)) void attend(
        const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, const Rows *rows, void *out,
        int num_rows, int num_heads, int kv_heads, int head_dim, int block_size, float scale, const int bf16,
        const int kv16) {
#if HAVE_BF16_DOT_ATTENTION
    if (pairs_layout(bf16 && kv16, head_dim, block_size)) { /* the cache is in the pairs layout: only this kernel reads it */
        if (head_dim == 64)
            attend_rows_bf16_dot(q, q_stride, k_cache, v_cache, rows, out, num_rows, num_heads, kv_heads, head_dim,
                                 block_size, scale, 4);
        else if (head_dim == 128)
            attend_rows_bf16_dot(q, q_stride, k_cache, v_cache, rows, out, num_rows, num_heads, kv_heads, head_dim,
                                 block_size, scale, 8);
        else
            attend_rows_bf16_dot(q, q_stride, k_cache, v_cache, rows, out, num_rows, num_heads, kv_heads, head_dim,
                                 block_size, scale, head_dim / 16);
        return;
    }
#endif
#if HAVE_VEC_ATTENTION
    if (head_dim % VL == 0 && block_size % KEY_CHUNK == 0) {
        const int chunks = head_dim / VL;
        if (chunks == 64 / VL)
            attend_rows_vec(q, q_stride, k_cache, v_cache, rows, out, num_rows, num_heads, kv_heads, head_dim,
                            block_size, scale, bf16, kv16, 64 / VL, value_dims(64 / VL));
        else if (chunks == 128 / VL)
            attend_rows_vec(q, q_stride, k_cache, v_cache, rows, out, num_rows, num_heads, kv_heads, head_dim,
                            block_size, scale, bf16, kv16, 128 / VL, value_dims(128 / VL));
        else if (value_dims(chunks) >= 2)
            attend_rows_vec(q, q_stride, k_cache, v_cache, rows, out, num_rows, num_heads, kv_heads, head_dim,
                            block_size, scale, bf16, kv16, chunks, 2);
        else
            attend_rows_vec(q, q_stride, k_cache, v_cache, rows, out, num_rows, num_heads, kv_heads, head_dim,
                            block_size, scale, bf16, kv16, chunks, 1);
        return;
    }
#endif
    attend_rows(q, q_stride, k_cache, v_cache, rows, out, num_rows, num_heads, kv_heads, head_dim, block_size, scale,
                bf16, kv16);
}

/* Each dtype's attention compiled once (not inlined into each entry point: the variants above
 * are most of the library's compile time), called inside the entry points' parallel regions. */
static __attribute__((noinline)) void attend_f32(const void *q, int64_t q_stride, const void *k_cache,
                                                 const void *v_cache, const Rows *rows, void *out, int num_rows,
                                                 int num_heads, int kv_heads, int head_dim, int block_size,
                                                 float scale) {
    attend(q, q_stride, k_cache, v_cache, rows, out, num_rows, num_heads, kv_heads, head_dim, block_size, scale, 0, 0);
}

static __attribute__((noinline)) void attend_f32_kv16(const void *q, int64_t q_stride, const void *k_cache,
                                                      const void *v_cache, const Rows *rows, void *out, int num_rows,
                                                      int num_heads, int kv_heads, int head_dim, int block_size,
                                                      float scale) {
    attend(q, q_stride, k_cache, v_cache, rows, out, num_rows, num_heads, kv_heads, head_dim, block_size, scale, 0, 1);
}

static __attribute__((noinline)) void attend_bf16(const void *q, int64_t q_stride, const void *k_cache,
                                                  const void *v_cache, const Rows *rows, void *out, int num_rows,
                                                  int num_heads, int kv_heads, int head_dim, int block_size,
                                                  float scale) {
    attend(q, q_stride, k_cache, v_cache, rows, out, num_rows, num_heads, kv_heads, head_dim, block_size, scale, 1, 1);
}

/* ------------------------------------------------------------------ entry points */

/* Decode rows, one query each: row b's query is at position context_lens[b] - 1 (token b: q row
 * b, out row b) and sees from first_positions[b]. The work-sharing bodies share the threads of an
 * enclosing parallel region (decoder.c's layer loop); called outside one, one thread does all.
 * The float32 entries read a float32 cache, or a bfloat16 one where kv16 is 1. */
static inline void attend_f32_any(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                   const Rows *rows, float *out, int num_rows, int num_heads, int kv_heads,
                                   int head_dim, int block_size, float scale, int kv16) {
    if (kv16)
        attend_f32_kv16(q, q_stride, k_cache, v_cache, rows, out, num_rows, num_heads, kv_heads, head_dim, block_size,
                        scale);
    else
        attend_f32(q, q_stride, k_cache, v_cache, rows, out, num_rows, num_heads, kv_heads, head_dim, block_size,
                   scale);
}

void paged_decode_rows_f32(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int32_t *block_table, int max_blocks, const int32_t *context_lens,
                           const int32_t *first_positions, float *out, int num_rows, int num_heads, int kv_heads,
                           int head_dim, int block_size, float scale, int kv16) {
    const Rows rows = {block_table, max_blocks, context_lens, 0, 0, first_positions, 0, 0.0f};
    attend_f32_any(q, q_stride, k_cache, v_cache, &rows, out, num_rows, num_heads, kv_heads, head_dim, block_size,
                    scale, kv16);
}

void paged_decode_rows_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int32_t *block_table, int max_blocks, const int32_t *context_lens,
                            const int32_t *first_positions, uint16_t *out, int num_rows, int num_heads, int kv_heads,
                            int head_dim, int block_size, float scale) {
    const Rows rows = {block_table, max_blocks, context_lens, 0, 0, first_positions, 0, 0.0f};
    attend_bf16(q, q_stride, k_cache, v_cache, &rows, out, num_rows, num_heads, kv_heads, head_dim, block_size, scale);
}

/* The same, in a parallel region of their own, scores soft-capped where softcap > 0. */
void paged_decode(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                  const int32_t *block_table, int max_blocks, const int32_t *context_lens,
                  const int32_t *first_positions, float *out, int num_rows, int num_heads,
                  int kv_heads, int head_dim, int block_size, float scale, float softcap, int kv16, int num_threads) {
    const Rows rows = {block_table, max_blocks, context_lens, 0, 0, first_positions, 0, softcap};
#pragma omp parallel num_threads(num_threads)
    attend_f32_any(q, q_stride, k_cache, v_cache, &rows, out, num_rows, num_heads, kv_heads, head_dim, block_size,
                    scale, kv16);
}

void paged_decode_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int32_t *block_table, int max_blocks, const int32_t *context_lens,
                       const int32_t *first_positions, uint16_t *out, int num_rows, int num_heads,
                       int kv_heads, int head_dim, int block_size, float scale, float softcap, int num_threads) {
    const Rows rows = {block_table, max_blocks, context_lens, 0, 0, first_positions, 0, softcap};
#pragma omp parallel num_threads(num_threads)
    attend_bf16(q, q_stride, k_cache, v_cache, &rows, out, num_rows, num_heads, kv_heads, head_dim, block_size, scale);
}

/* Rows of any length (prefill chunks, decode rows, mixed): row r computes lengths[r] queries
 * ending at position ends[r] - 1, at flat tokens first_tokens[r] onwards (q rows q_stride elements
 * apart; out [tokens, heads, head_dim] contiguous); with a sliding window (window > 0) a query at
 * p sees from max(first_positions[r], p - window + 1); scores soft-capped where softcap > 0. */
void paged_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                     const int32_t *block_table, int max_blocks, const int32_t *ends, const int32_t *lengths,
                     const int32_t *first_tokens, const int32_t *first_positions, int window, float *out,
                     int num_rows, int num_heads, int kv_heads, int head_dim, int block_size, float scale,
                     float softcap, int kv16, int num_threads) {
    const Rows rows = {block_table, max_blocks, ends, lengths, first_tokens, first_positions, window, softcap};
#pragma omp parallel num_threads(num_threads)
    attend_f32_any(q, q_stride, k_cache, v_cache, &rows, out, num_rows, num_heads, kv_heads, head_dim, block_size,
                    scale, kv16);
}

void paged_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *block_table, int max_blocks, const int32_t *ends, const int32_t *lengths,
                          const int32_t *first_tokens, const int32_t *first_positions, int window, uint16_t *out,
                          int num_rows, int num_heads, int kv_heads, int head_dim, int block_size, float scale,
                          float softcap, int num_threads) {
    const Rows rows = {block_table, max_blocks, ends, lengths, first_tokens, first_positions, window, softcap};
#pragma omp parallel num_threads(num_threads)
    attend_bf16(q, q_stride, k_cache, v_cache, &rows, out, num_rows, num_heads, kv_heads, head_dim, block_size, scale);
}

/* Which path attention takes, for the start-up log: 2 vdpbf16ps for bfloat16 caches in the pairs
 * layout (and the vector path otherwise), 1 the vector path (VL lanes), 0 the plain loops. */
int attention_path(void) { return HAVE_BF16_DOT_ATTENTION ? 2 : HAVE_VEC_ATTENTION; }

int vector_lanes(void) {
#ifdef VL
    return VL;
#else
    return 0;
#endif
}
