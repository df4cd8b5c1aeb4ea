/* Quantized products for x86-64 CPUs with AVX2, FMA and F16C: weights in 4 or 8 bits, activations
 * quantized to 16 bits in groups of 32, multiplied as 16-bit integer pairs (vpmaddwd). llama.cpp quantizes
 * activations to 8 bits (Q8_1); 16 keeps a small model's greedy answers those of its float weights, at a
 * few percent of speed (docs/models.md).
 *
 * Built at run time by kvsnap.models.qkernel (cc -O3 -mavx2 -mfma -mf16c -fopenmp) and called through
 * ctypes with the tensors' pointers. Every output element is one dot product computed by one thread in
 * a fixed order, so a row's result does not depend on how many rows a call holds, on the thread count
 * or on which thread ran it.
 *
 * Layouts (K: the input width, a multiple of 32; G = K / 32 groups):
 *   activations  xq int16 [M, K], xd float [M, G] (scale), xs float [M, G] (scale * sum of the group's codes)
 *   int4 weights codes uint8 [N, K / 2]: a group's 16 bytes hold its elements j (low nibble) and j + 16
 *                (high nibble); d, m float16 [N, G]: w = d * code + m
 *   int8 weights codes int8 [N, K], d float16 [N, G]: w = d * code (GGUF's Q8_0, whose own codes and scales
 *                are these: a Q8_0 file's dequantized weights quantize back to them exactly)
 *   the KV cache  float16 bits (kv_half): half a float32 cache's bytes for the attention to read, and a
 *                snapshot's; written rounded to nearest even, as torch's .to(torch.float16) rounds
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32

typedef int16_t act_t; /* activation codes */
#define ACT_MAX 32767.0f

typedef uint16_t kv_half; /* a cached key or value, float16 bits */

static inline __m256 load_half8(const kv_half *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* One group of 32 floats to int16: scale = max|x| / 32767, code = round(x / scale). */
static inline void quantize_group(const float *src, act_t *xq, float *xd, float *xs, int64_t r) {
    float amax = 0.0f;
    for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(src[i]));
    const float d = amax / ACT_MAX;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int i = 0; i < GROUP; i++) {
        const int q = (int)lrintf(src[i] * inv);
        xq[r * GROUP + i] = (act_t)q;
        sum += q;
    }
    xd[r] = d;
    xs[r] = d * (float)sum;
}

/* Quantize M rows of K floats in groups of 32 (quantize_group). */
void kv_quantize_rows(const float *x, int64_t M, int64_t K, act_t *xq, float *xd, float *xs) {
    const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M * G; r++) quantize_group(x + r * GROUP, xq, xd, xs, r);
}

/* One group's 32 integer products, as 8 int32 partial sums. */
static inline __m256i product_q4(const uint8_t *w4, const act_t *x) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)w4), low = _mm_set1_epi8(0x0F);
    const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low));
    const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low));
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
}

static inline __m256i product_q8(const int8_t *w8, const act_t *x) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)w8);
    const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
    const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
}

/* One int4 weight row by one quantized activation row: sum over groups of d * xd * (codes . xq) + m * xs.
 * The per-group scales d * xd and the min term are formed 8 groups at a time first, so the main loop is
 * integer products and one multiply-add a group. */
static inline float dot_q4(const act_t *xq, const float *xd, const float *xs, const uint8_t *wrow,
                           const uint16_t *drow, const uint16_t *mrow, int64_t G) {
    float sc[G];
    __m256 ex = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(drow + g)));
        const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mrow + g)));
        _mm256_storeu_ps(sc + g, _mm256_mul_ps(d8, _mm256_loadu_ps(xd + g)));
        ex = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xs + g), ex);
    }
    float extra = hsum(ex);
    for (; g < G; g++) {
        sc[g] = _cvtsh_ss(drow[g]) * xd[g];
        extra += _cvtsh_ss(mrow[g]) * xs[g];
    }
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (g = 0; g + 3 < G; g += 4) { /* four chains: the accumulations' latency overlaps */
        for (int j = 0; j < 4; j++) {
            const __m256i p = product_q4(wrow + (g + j) * (GROUP / 2), xq + (g + j) * GROUP);
            acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + g + j), _mm256_cvtepi32_ps(p), acc[j]);
        }
    }
    for (; g < G; g++) {
        const __m256i p = product_q4(wrow + g * (GROUP / 2), xq + g * GROUP);
        acc[0] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + g), _mm256_cvtepi32_ps(p), acc[0]);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))) + extra;
}

/* One int8 weight row by one quantized activation row: sum over groups of d * xd * (codes . xq), the
 * per-group scales formed 8 groups at a time first, as dot_q4 forms them. */
static inline float dot_q8(const act_t *xq, const float *xd, const int8_t *wrow, const uint16_t *drow, int64_t G) {
    float sc[G];
    int64_t g = 0;
    for (; g + 8 <= G; g += 8)
        _mm256_storeu_ps(sc + g, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(drow + g))),
                                               _mm256_loadu_ps(xd + g)));
    for (; g < G; g++) sc[g] = _cvtsh_ss(drow[g]) * xd[g];
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (g = 0; g + 3 < G; g += 4) { /* four chains: the accumulations' latency overlaps */
        for (int j = 0; j < 4; j++) {
            const __m256i p = product_q8(wrow + (g + j) * GROUP, xq + (g + j) * GROUP);
            acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + g + j), _mm256_cvtepi32_ps(p), acc[j]);
        }
    }
    for (; g < G; g++) {
        const __m256i p = product_q8(wrow + g * GROUP, xq + g * GROUP);
        acc[0] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + g), _mm256_cvtepi32_ps(p), acc[0]);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

/* -- a layer's forward over M rows (kvsnap.models.qstep) ---------------------------------------------
 * Every row is computed on its own, by the same code whatever M is: a token's KV and output do not depend
 * on how many tokens a forward runs, or on the threads. */

typedef struct {
    int64_t bits;       /* 4 or 8 */
    const void *codes;  /* int4: uint8 [N, K / 2]; int8: int8 [N, K] */
    const void *scales; /* float16 [N, G] (d) */
    const void *mins;   /* int4: float16 [N, G]; int8: unused */
    const float *bias;  /* float [N], or NULL */
    int64_t n, k;
} kv_matrix;

/* What a layer's forward takes that does not change from call to call. */
typedef struct {
    kv_matrix qkv, o, gate_up, down;
    const float *norm_in, *norm_post; /* the two norms' weights, float [hidden] */
    float eps_in, eps_post, scale;    /* the norms' eps, the attention's scale */
    int64_t hidden, inter, heads, kv_heads, head_dim;
} kv_layer;

/* One call's rows, cache and scratch. x [M, hidden] is updated in place; qkv [M, q | k | v] is written by
 * kv_layer_qkv (which also writes k and v into the cache) and read by kv_layer_rest; keys/values: [kv_heads, positions, head_dim] with the given
 * strides (in elements), `length` positions once this call's are in. Scratch: h [M, max(hidden, inter)],
 * attn [M, heads * head_dim], act [M, 2 * inter], xq/xd/xs for M rows of the widest input. */
typedef struct {
    float *x;
    int64_t m;
    const float *cos, *sin_signed; /* [M, head_dim] each; sin with its first half negated */
    float *qkv;
    kv_half *keys, *values; /* the new rows' k and v are written at positions length - M .. length - 1 */
    int64_t head_stride, pos_stride, length;
    float *h, *attn, *act;
    act_t *xq;
    float *xd, *xs;
} kv_call;

/* out[M, N] = x[M, K] W^T + bias (x's rows ldx floats apart), the activations quantized into xq [M, K], xd
 * and xs [M, K / 32]. Called by every thread of a parallel region: the work is shared with `omp for`. */
static void products_team(const kv_matrix *w, const act_t *xq, const float *xd, const float *xs, int64_t M,
                          float *out);

static void product_team(const kv_matrix *w, const float *x, int64_t ldx, int64_t M, float *out, act_t *xq, float *xd,
                         float *xs) {
    const int64_t G = w->k / GROUP;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M * G; r++) quantize_group(x + (r / G) * ldx + (r % G) * GROUP, xq, xd, xs, r);
    products_team(w, xq, xd, xs, M, out);
}

/* out[M, N] = xq W^T + bias over activations quantized already; shared like product_team. */
static void products_team(const kv_matrix *w, const act_t *xq, const float *xd, const float *xs, int64_t M,
                          float *out) {
    const int64_t G = w->k / GROUP;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < w->n; n++) {
        for (int64_t m = 0; m < M; m++) {
            float v;
            if (w->bits == 4)
                v = dot_q4(xq + m * w->k, xd + m * G, xs + m * G, (const uint8_t *)w->codes + n * (w->k / 2),
                           (const uint16_t *)w->scales + n * G, (const uint16_t *)w->mins + n * G, G);
            else
                v = dot_q8(xq + m * w->k, xd + m * G, (const int8_t *)w->codes + n * w->k,
                           (const uint16_t *)w->scales + n * G, G);
            out[m * w->n + n] = w->bias ? v + w->bias[n] : v;
        }
    }
}

/* x * rsqrt(mean(x^2) + eps) * weight, per row of M. */
static void rms_norm_team(const float *x, const float *weight, float eps, int64_t M, int64_t n, float *out) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * n;
        float *o = out + m * n;
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) sum += (double)xr[i] * xr[i];
        const float r = 1.0f / sqrtf((float)(sum / (double)n) + eps);
        for (int64_t i = 0; i < n; i++) o[i] = xr[i] * r * weight[i];
    }
}

/* exp for x <= 0 (softmax after subtracting the max), 8 lanes: 2^(x log2 e) split into 2^n 2^f, 2^f by a
 * degree-6 polynomial (relative error ~2e-7, about expf's own rounding). */
static inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.6931471805599453f));
    __m256 p = _mm256_set1_ps(1.3888949e-3f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3333270e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1666662e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666667e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Eight dot products of q with the cached rows k, k + stride, ..., k + 7 * stride (d a multiple of 8). */
static inline __m256 dots8(const float *q, const kv_half *k, int64_t stride, int64_t d) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, load_half8(k + j * stride + i), a[j]);
    }
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* q . k for one cached row k (n a multiple of 8, as the kernel forward's head_dim is). */
static inline float dot_half(const float *q, const kv_half *k, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_half8(k + i), acc);
    return hsum(acc);
}

/* The first half of a layer: out [M, q | k | v] of norm(x [M, hidden]), q and k rotated by each row's
 * cos/sin [M, head_dim] (sin with its first half negated). h: [M, hidden] scratch. */
void kv_layer_qkv(const kv_layer *layer, const kv_call *c) {
    const int64_t M = c->m, head_dim = layer->head_dim, rotated_heads = layer->heads + layer->kv_heads;
    const int64_t half = head_dim / 2, width = layer->qkv.n;
    float *out = c->qkv;
#pragma omp parallel
    {
        rms_norm_team(c->x, layer->norm_in, layer->eps_in, M, layer->hidden, c->h);
        product_team(&layer->qkv, c->h, layer->hidden, M, out, c->xq, c->xd, c->xs);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < M * rotated_heads; task++) {
            const int64_t m = task / rotated_heads, hd = task % rotated_heads;
            const float *cs = c->cos + m * head_dim, *sn = c->sin_signed + m * head_dim;
            float *v = out + m * width + hd * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * cs[i] + b * sn[i];
                v[i + half] = b * cs[i + half] + a * sn[i + half];
            }
        }
        const int64_t kv_heads = layer->kv_heads, q_width = layer->heads * head_dim, kv_width = kv_heads * head_dim;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < M * kv_heads; task++) { /* this call's k and v into the cache */
            const int64_t m = task / kv_heads, hd = task % kv_heads, at = hd * c->head_stride + (c->length - M + m) * c->pos_stride;
            const float *row = out + m * width + q_width + hd * head_dim;
            for (int64_t i = 0; i < head_dim; i++) {
                c->keys[at + i] = _cvtss_sh(row[i], _MM_FROUND_TO_NEAREST_INT);
                c->values[at + i] = _cvtss_sh(row[kv_width + i], _MM_FROUND_TO_NEAREST_INT);
            }
        }
    }
}

/* Attention is computed for a tile of rows at a time, in three shared passes: the scores (each block of 8
 * keys is read once for every row and query head of its kv head), each (row, head)'s softmax, and the
 * weighted values (each value row's slice of 8-32 outputs read once for a tile's rows and heads,
 * accumulated in registers up to four heads at a time). For every (row, head, output) the arithmetic is a fixed sequence
 * whatever the tile, the split between threads or M: dots8 for each whole block of 8 positions from 0 and
 * dot_half for the rest, the max, the exponentials summed in one order, then one fused multiply-add per
 * position in order, scaled by 1 / sum at the end. */
#define POS_BLOCK 256            /* positions per score task (a multiple of 8) */
#define PV_BLOCK 64              /* positions whose values stay in L1 while a tile's rows use them */
#define HEAD_BATCH 4             /* query heads accumulated in registers together */
#define SCORE_BUDGET (1L << 22)  /* floats of scores a tile of rows may hold */

typedef struct {
    const float *q;
    const kv_half *keys, *values;
    float *attn, *scores, *inv;
    int64_t m, heads, kv_heads, head_dim, q_stride, head_stride, pos_stride, length, tile;
    float scale;
} attention_job;

/* acc[h] (nv vectors of 8 outputs each) += p[h][l] * v[l] for l in [l0, l1); nh and nv constants once
 * inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void weigh_values(int nh, int nv, const kv_half *v, int64_t pos_stride,
                                                               const float *const *p, float *const *out,
                                                               int64_t l0, int64_t l1) {
    __m256 acc[HEAD_BATCH][4];
    for (int h = 0; h < nh; h++)
        for (int j = 0; j < nv; j++) acc[h][j] = _mm256_loadu_ps(out[h] + 8 * j);
    for (int64_t l = l0; l < l1; l++) {
        __m256 vl[4];
        for (int j = 0; j < nv; j++) vl[j] = load_half8(v + l * pos_stride + 8 * j);
        for (int h = 0; h < nh; h++) {
            const __m256 w = _mm256_broadcast_ss(p[h] + l);
            for (int j = 0; j < nv; j++) acc[h][j] = _mm256_fmadd_ps(w, vl[j], acc[h][j]);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int j = 0; j < nv; j++) _mm256_storeu_ps(out[h] + 8 * j, acc[h][j]);
}

static void weigh_values_n(int nh, int nv, const kv_half *v, int64_t pos_stride, const float *const *p,
                           float *const *out, int64_t l0, int64_t l1) {
#define WEIGH(NH)                                                                                        \
    case NH:                                                                                             \
        if (nv == 4) weigh_values(NH, 4, v, pos_stride, p, out, l0, l1);                                 \
        else if (nv == 2) weigh_values(NH, 2, v, pos_stride, p, out, l0, l1);                            \
        else weigh_values(NH, 1, v, pos_stride, p, out, l0, l1);                                         \
        break;
    switch (nh) {
        WEIGH(1)
        WEIGH(2)
        WEIGH(3)
        WEIGH(4)
    }
#undef WEIGH
}

static void attention_team(const attention_job *a) {
    const int64_t M = a->m, heads = a->heads, kv_heads = a->kv_heads, head_dim = a->head_dim;
    const int64_t groups = heads / kv_heads, pos_stride = a->pos_stride, row_width = heads * head_dim;
    /* outputs per value task: 32 (four vectors) where a batch's accumulators fit the 16 registers */
    const int64_t nv = head_dim % 32 == 0 && groups <= 3 ? 4 : head_dim % 16 == 0 ? 2 : 1, chunks = head_dim / (8 * nv);
    for (int64_t r0 = 0; r0 < M; r0 += a->tile) {
        const int64_t rows = M - r0 < a->tile ? M - r0 : a->tile, first = a->length - M + r0 + 1;
        const int64_t span = first + rows - 1; /* the last row's positions, the scores' row stride */
        const int64_t blocks = (span + POS_BLOCK - 1) / POS_BLOCK;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * blocks; task++) {
            const int64_t kh = task / blocks, l_start = (task % blocks) * POS_BLOCK;
            const int64_t l_end = l_start + POS_BLOCK < span ? l_start + POS_BLOCK : span;
            const kv_half *kh_keys = a->keys + kh * a->head_stride;
            for (int64_t l0 = l_start; l0 < l_end; l0 += 8) {
                const kv_half *k = kh_keys + l0 * pos_stride;
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t seen = first + r;
                    if (l0 >= seen) continue;
                    for (int64_t g = 0; g < groups; g++) {
                        const int64_t hq = kh * groups + g;
                        const float *qh = a->q + (r0 + r) * a->q_stride + hq * head_dim;
                        float *sc = a->scores + (r * heads + hq) * span;
                        if (l0 + 8 <= seen)
                            _mm256_storeu_ps(sc + l0, _mm256_mul_ps(dots8(qh, k, pos_stride, head_dim),
                                                                    _mm256_set1_ps(a->scale)));
                        else
                            for (int64_t l = l0; l < seen; l++)
                                sc[l] = dot_half(qh, kh_keys + l * pos_stride, head_dim) * a->scale;
                    }
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * heads; task++) { /* softmax: the max, exponentials, their sum */
            const int64_t seen = first + task / heads;
            float *sc = a->scores + task * span;
            int64_t l = 0;
            __m256 top8 = _mm256_set1_ps(-INFINITY);
            for (; l + 8 <= seen; l += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(sc + l));
            float top = hmax(top8);
            for (; l < seen; l++) top = fmaxf(top, sc[l]);
            __m256 total = _mm256_setzero_ps();
            for (l = 0; l + 8 <= seen; l += 8) {
                const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sc + l), _mm256_set1_ps(top)));
                _mm256_storeu_ps(sc + l, e);
                total = _mm256_add_ps(total, e);
            }
            float sum = hsum(total);
            for (; l < seen; l++) {
                sc[l] = expf(sc[l] - top);
                sum += sc[l];
            }
            a->inv[task] = 1.0f / sum;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * chunks; task++) {
            const int64_t kh = task / chunks, i0 = (task % chunks) * 8 * nv;
            const kv_half *v = a->values + kh * a->head_stride + i0;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t g = 0; g < groups; g++)
                    memset(a->attn + (r0 + r) * row_width + (kh * groups + g) * head_dim + i0, 0,
                           sizeof(float) * 8 * (size_t)nv);
            for (int64_t l0 = 0; l0 < span; l0 += PV_BLOCK) {
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t seen = first + r;
                    if (l0 >= seen) continue;
                    const int64_t l1 = l0 + PV_BLOCK < seen ? l0 + PV_BLOCK : seen;
                    for (int64_t g0 = 0; g0 < groups; g0 += HEAD_BATCH) {
                        const int nh = (int)(groups - g0 < HEAD_BATCH ? groups - g0 : HEAD_BATCH);
                        const float *p[HEAD_BATCH];
                        float *out[HEAD_BATCH];
                        for (int h = 0; h < nh; h++) {
                            const int64_t hq = kh * groups + g0 + h;
                            p[h] = a->scores + (r * heads + hq) * span;
                            out[h] = a->attn + (r0 + r) * row_width + hq * head_dim + i0;
                        }
                        weigh_values_n(nh, (int)nv, v, pos_stride, p, out, l0, l1);
                    }
                }
            }
            for (int64_t r = 0; r < rows; r++)
                for (int64_t g = 0; g < groups; g++) {
                    const int64_t hq = kh * groups + g;
                    float *o = a->attn + (r0 + r) * row_width + hq * head_dim + i0;
                    const __m256 inv = _mm256_set1_ps(a->inv[r * heads + hq]);
                    for (int64_t j = 0; j < nv; j++) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(o + 8 * j), inv));
                }
        }
    }
}

/* The rest of a layer, x [M, hidden] updated in place. Row m (position length - M + m) attends to the
 * cached positions 0..length - M + m; q: row m's at q + m * q_stride. keys/values: [kv_heads, positions,
 * head_dim] with the given strides (in elements). Then the output projection and residual, the MLP's norm,
 * gate/up ([gate | up]), silu(gate) * up, down and the residual. Scratch: attn [M, heads * head_dim],
 * h [M, hidden], act [M, 2 * inter], xq/xd/xs for the widest input. Returns 0, or -1 where the scores'
 * memory could not be had (nothing written). */
int kv_layer_rest(const kv_layer *layer, const kv_call *c) {
    const int64_t M = c->m, heads = layer->heads, hidden = layer->hidden, inter = layer->inter;
    float *x = c->x, *attn = c->attn, *h = c->h, *act = c->act, *xd = c->xd, *xs = c->xs;
    act_t *xq = c->xq;
    const kv_matrix *o = &layer->o, *gate_up = &layer->gate_up, *down = &layer->down;
    const int64_t positions = c->length > 0 ? c->length : 1;
    int64_t tile = SCORE_BUDGET / (heads * positions);
    tile = tile < 1 ? 1 : tile > M ? M : tile;
    float *scores = (float *)malloc(sizeof(float) * (size_t)(tile * heads * positions));
    float *inv = (float *)malloc(sizeof(float) * (size_t)(tile * heads));
    if (scores == NULL || inv == NULL) {
        free(scores);
        free(inv);
        return -1;
    }
    const attention_job job = {c->qkv, c->keys, c->values, attn, scores, inv, M, heads, layer->kv_heads,
                               layer->head_dim, layer->qkv.n, c->head_stride, c->pos_stride, c->length, tile,
                               layer->scale};
#pragma omp parallel
    {
        attention_team(&job);
        product_team(o, attn, heads * layer->head_dim, M, h, xq, xd, xs);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * hidden; i++) x[i] += h[i];
        rms_norm_team(x, layer->norm_post, layer->eps_post, M, hidden, h);
        product_team(gate_up, h, hidden, M, act, xq, xd, xs); /* [M, gate | up] */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M * inter; r++) { /* silu(gate) * up, into the gate's place */
            float *a = act + (r / inter) * 2 * inter + r % inter;
            *a = *a / (1.0f + expf(-*a)) * a[inter];
        }
        product_team(down, act, 2 * inter, M, h, xq, xd, xs);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * hidden; i++) x[i] += h[i];
    }
    free(scores);
    free(inv);
    return 0;
}

/* A decode step or chunk through every layer: layer l's cache at keys[l], values[l], its head and position
 * strides at strides[2 l], strides[2 l + 1]. */
int kv_layers(int64_t n_layers, const kv_layer *layers, kv_call *c, kv_half *const *keys, kv_half *const *values,
              const int64_t *strides) {
    for (int64_t l = 0; l < n_layers; l++) {
        c->keys = keys[l];
        c->values = values[l];
        c->head_stride = strides[2 * l];
        c->pos_stride = strides[2 * l + 1];
        kv_layer_qkv(&layers[l], c);
        if (kv_layer_rest(&layers[l], c) != 0) return -1;
    }
    return 0;
}

/* Weights to int4 in groups of 32, as kvsnap.models.quantize.int4_pairs does (the same float32 arithmetic,
 * float16 rounding to nearest even, codes rounded half to even): w [N, K] float32 in, codes [N, K / 2]
 * (element j low nibble, j + 16 high), d and mins float16 [N, K / 32] out. */
void kv_quantize_q4(const float *w, int64_t N, int64_t K, uint8_t *codes, uint16_t *d, uint16_t *mins) {
    const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < N * G; r++) {
        const float *src = w + r * GROUP;
        float low = src[0], high = src[0];
        for (int i = 1; i < GROUP; i++) {
            low = fminf(low, src[i]);
            high = fmaxf(high, src[i]);
        }
        const uint16_t scale_h = _cvtss_sh((high - low) / 15.0f, _MM_FROUND_TO_NEAREST_INT);
        float scale = _cvtsh_ss(scale_h);
        uint16_t scale_bits = scale_h;
        if (!(scale >= 6.103515625e-05f)) { /* float16's smallest normal, as the clamp in int4_pairs */
            scale = 6.103515625e-05f;
            scale_bits = 0x0400;
        }
        const uint16_t low_h = _cvtss_sh(low, _MM_FROUND_TO_NEAREST_INT);
        const float low_f = _cvtsh_ss(low_h);
        uint8_t *out = codes + r * (GROUP / 2);
        for (int j = 0; j < GROUP / 2; j++) {
            const float a = nearbyintf((src[j] - low_f) / scale), b = nearbyintf((src[j + 16] - low_f) / scale);
            const int qa = a < 0.0f ? 0 : a > 15.0f ? 15 : (int)a, qb = b < 0.0f ? 0 : b > 15.0f ? 15 : (int)b;
            out[j] = (uint8_t)(qa | (qb << 4));
        }
        d[r] = scale_bits;
        mins[r] = low_h;
    }
}

/* out[M, N] = x W^T over int4 weights, x quantized already (kv_quantize_rows). */
void kv_matmul_q4(const act_t *xq, const float *xd, const float *xs, int64_t M, const uint8_t *codes,
                  const uint16_t *d, const uint16_t *mins, int64_t N, int64_t K, float *out) {
    const kv_matrix w = {4, codes, d, mins, NULL, N, K};
#pragma omp parallel
    products_team(&w, xq, xd, xs, M, out);
}

/* out[M, N] = x W^T over int8 weights, x quantized already (kv_quantize_rows). */
void kv_matmul_q8(const act_t *xq, const float *xd, int64_t M, const int8_t *codes, const uint16_t *d, int64_t N,
                  int64_t K, float *out) {
    const kv_matrix w = {8, codes, d, NULL, NULL, N, K};
#pragma omp parallel
    products_team(&w, xq, xd, NULL, M, out);
}

int kv_abi_version(void) { return 12; }


