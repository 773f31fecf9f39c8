/* Fused paged decode attention for the CPU: one query token per sequence, K/V read in place.
 *
 * C99 with GNU vector extensions (gcc, clang), no torch headers, so it compiles in about a
 * second at first use (kvpool/kernels/cpu.py). A work item is one (sequence, kv head) pair,
 * whose G = num_heads / num_kv_heads query rows share that KV head. A thread takes a chunk (one
 * sequence, several kv heads) and walks its visible pages once, so each page streams in front
 * to back while the next one is prefetched. Per page: scores of its tokens for all rows, one
 * online-softmax rescale per row (flash decoding), then p * V accumulated in float32.
 *
 * An fp8 cache (float8_e4m3fn bytes) is widened to float32 in registers; its K scale is folded
 * into the query and its V scale into the output, so the inner loops only widen bytes.
 *
 * Only visible slots [first, seq_len) are read: unwritten slots may hold any bits, NaN included.
 * Built without -ffast-math.
 */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VEC 16 /* floats per vector; head_dim must be a multiple */
#define MAX_THREADS 64
#define LOG2E 1.4426950408889634f

typedef float vf __attribute__((vector_size(4 * VEC)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(4 * VEC)));
typedef uint32_t vu __attribute__((vector_size(4 * VEC)));
typedef uint16_t vh __attribute__((vector_size(2 * VEC)));
typedef uint8_t vb __attribute__((vector_size(VEC)));

/* Mirrored field for field by kvpool/kernels/cpu.py (_Problem). Strides are in elements. */
typedef struct {
    const void *q;             /* [batch, num_heads, head_dim], contiguous */
    void *out;                 /* same shape and dtype as q */
    const void *k_cache;       /* [num_pages, page_size, num_kv_heads, head_dim], last dim dense */
    const void *v_cache;
    int64_t k_strides[3];      /* page, slot, head */
    int64_t v_strides[3];
    const int32_t *page_tables; /* [batch, table_stride] */
    const int32_t *seq_lens;   /* [batch] */
    int64_t table_stride;
    int64_t batch, num_heads, num_kv_heads, head_dim, page_size, num_pages;
    int64_t window;            /* sliding window in tokens, 0 for none */
    double scale;
    double softcap;            /* scores s become softcap * tanh(s / softcap); 0 for none */
    const float *sinks;        /* [num_heads] logits joining each row's denominator; NULL: none */
    int32_t bf16;              /* 1: q, out (and K, V unless fp8) are bfloat16; 0: float32 */
    int32_t fp8;               /* 1: K, V are float8_e4m3fn bytes */
    double k_scale, v_scale;   /* fp8 only: a stored byte b means e4m3(b) * scale */
} Problem;

/* Work shared by the threads of one call: chunk c is sequence c / parts, kv heads
 * [c % parts * kv / parts, (c % parts + 1) * kv / parts). Threads take chunks off `next`, so a
 * thread slowed down (say by another pool's spinning workers on its core) takes fewer. */
typedef struct {
    const Problem *p;
    int64_t parts, chunks;
    int64_t next;
    int status;
} Work;

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE vf load_f32(const float *x)
{
    vf v;
    memcpy(&v, x, sizeof v);
    return v;
}

ALWAYS_INLINE void store_f32(float *x, vf v)
{
    memcpy(x, &v, sizeof v);
}

/* VEC elements of a float32 or bfloat16 row from element i, as floats. */
ALWAYS_INLINE vf load_row(const void *x, int64_t i, int bf16)
{
    if (bf16) {
        vh bits;
        memcpy(&bits, (const uint16_t *)x + i, sizeof bits);
        return (vf)(__builtin_convertvector(bits, vu) << 16);
    }
    return load_f32((const float *)x + i);
}

/* VEC float8_e4m3fn bytes (sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinity;
 * magnitude 0x7F is NaN) as floats, exactly. Each byte's bits move to their places in a float
 * (sign bit 31, exponent and mantissa at bits 20-26), which makes the float the e4m3 value times
 * 2^-120 (e4m3 subnormals become float subnormals, so this assumes denormals are not flushed:
 * the default), and a product with 2^120 restores the exponent. One sign-extending widen (a
 * single instruction with AVX-512) and four vector operations: far cheaper than a table. */
ALWAYS_INLINE vf load_e4m3(const uint8_t *x)
{
#if defined(__AVX512F__) && VEC == 16
    const vi bytes = (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x));
#else
    vi bytes;
    for (int j = 0; j < VEC; j++)
        bytes[j] = (int8_t)x[j];
#endif
    const vi bits = (bytes << 20) & (int32_t)0x87F00000;
    const vi value = (vi)((vf)bits * 0x1p120f);
    const vi nan = (bits & 0x7FFFFFFF) == 0x07F00000; /* would read as +-480 */
    return (vf)((value & ~nan) | (((vi){0} + 0x7FC00000) & nan));
}

/* VEC elements of a K or V row from element i, as floats: float32, bfloat16 or fp8 bytes. */
ALWAYS_INLINE vf load_kv(const void *x, int64_t i, int bf16, int fp8)
{
    if (fp8)
        return load_e4m3((const uint8_t *)x + i);
    return load_row(x, i, bf16);
}

ALWAYS_INLINE float load_one(const void *x, int64_t i, int bf16)
{
    if (bf16) {
        uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)x)[i];
}

static inline uint16_t to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays a (quiet) NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);      /* round to nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

#if defined(__clang__) || __GNUC__ >= 12
#define HALVES(x) __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
#define QUARTERS(x) __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)
#define PAIRS(x) __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
#define NEIGHBOURS(x) __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)

/* The sum of x's lanes (folded in halves, so the order is fixed). */
ALWAYS_INLINE float sum_lanes(vf x)
{
    x += HALVES(x);
    x += QUARTERS(x);
    x += PAIRS(x);
    x += NEIGHBOURS(x);
    return x[0];
}

/* The lane sums of a, b, c, d, reduced together: 8 shuffles instead of 16. */
ALWAYS_INLINE void sum_lanes4(vf a, vf b, vf c, vf d, float *out, int64_t stride)
{
    const vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                          22, 23)
                  + __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                            28, 29, 30, 31);
    const vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                          22, 23)
                  + __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                            28, 29, 30, 31);
    vf x = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                   27)
           + __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                                     30, 31);
    x += PAIRS(x);
    x += NEIGHBOURS(x);
    out[0] = x[0];
    out[stride] = x[4];
    out[2 * stride] = x[8];
    out[3 * stride] = x[12];
}
#else
ALWAYS_INLINE float sum_lanes(vf x)
{
    float sum = 0.0f;
    for (int i = 0; i < VEC; i++)
        sum += x[i];
    return sum;
}

ALWAYS_INLINE void sum_lanes4(vf a, vf b, vf c, vf d, float *out, int64_t stride)
{
    out[0] = sum_lanes(a);
    out[stride] = sum_lanes(b);
    out[2 * stride] = sum_lanes(c);
    out[3 * stride] = sum_lanes(d);
}
#endif

ALWAYS_INLINE vf max_lanes(vf a, vf b)
{
    const vi take_a = a > b;
    return (vf)(((vi)a & take_a) | ((vi)b & ~take_a));
}

/* 2^x for x <= 0 to about 1 ulp; exactly 0 below -126 (and for -inf). */
ALWAYS_INLINE vf exp2_lanes(vf x)
{
    const vi normal = x >= -126.0f;
    x = (vf)(((vi)x & normal) | ((vi)((vf){0} - 126.0f) & ~normal));
    const vf whole = (x + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    const vf f = x - whole;                            /* in [-0.5, 0.5] */
    /* Taylor series of e^(f ln 2) to degree 7: error below 1e-8 on [-0.5, 0.5]. */
    vf y = (vf){0} + 1.5252733804059841e-05f;
    y = y * f + 1.5403530393381609e-04f;
    y = y * f + 1.3333558146428443e-03f;
    y = y * f + 9.6181291076284772e-03f;
    y = y * f + 5.5504108664821580e-02f;
    y = y * f + 2.4022650695910071e-01f;
    y = y * f + 6.9314718055994531e-01f;
    y = y * f + 1.0f;
    const vi exponent = (__builtin_convertvector(whole, vi) + 127) << 23;
    return (vf)((vi)(y * (vf)exponent) & normal);
}

ALWAYS_INLINE float max_of(vf x)
{
    float top = x[0];
    for (int i = 1; i < VEC; i++)
        top = x[i] > top ? x[i] : top;
    return top;
}

/* Prefetches `count` rows of `bytes` bytes, `step` bytes apart, into L1 (`near`) or L2. Pages
 * are scattered, so the hardware prefetcher cannot guess where the next one starts. */
ALWAYS_INLINE void prefetch_rows(const char *x, int64_t count, int64_t step, int64_t bytes,
                                 int near)
{
    for (int64_t r = 0; r < count; r++)
        for (int64_t i = 0; i < bytes; i += 64) {
            if (near)
                __builtin_prefetch(x + r * step + i, 0, 3);
            else
                __builtin_prefetch(x + r * step + i, 0, 2);
        }
}

/* s[g * stride] = q_g . k for the g_rows rows `qs` [g_rows, d]; four rows share each K load. */
ALWAYS_INLINE void score_slot(const float *restrict qs, const void *k, int64_t d, int64_t g_rows,
                              float *restrict s, int64_t stride, int bf16, int fp8)
{
    int64_t g = 0;
    for (; g + 4 <= g_rows; g += 4) {
        const float *q = qs + g * d;
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t i = 0; i < d; i += VEC) {
            const vf kv = load_kv(k, i, bf16, fp8);
            a0 += load_f32(q + i) * kv;
            a1 += load_f32(q + d + i) * kv;
            a2 += load_f32(q + 2 * d + i) * kv;
            a3 += load_f32(q + 3 * d + i) * kv;
        }
        sum_lanes4(a0, a1, a2, a3, s + g * stride, stride);
    }
    for (; g < g_rows; g++) {
        vf a = {0};
        for (int64_t i = 0; i < d; i += VEC)
            a += load_f32(qs + g * d + i) * load_kv(k, i, bf16, fp8);
        s[g * stride] = sum_lanes(a);
    }
}

/* acc[g] += sum over tokens t < n of w[g * stride + t] * v_t, for the g_rows rows of `acc`
 * [g_rows, d] and one kv head's V rows v_t = v + t * slot; four rows share each V load, and
 * accumulate in registers across the page. */
ALWAYS_INLINE void accumulate_head(float *restrict acc, const char *v, int64_t slot, int64_t n,
                                   int64_t d, int64_t g_rows, const float *restrict w,
                                   int64_t stride, int bf16, int fp8)
{
    int64_t g = 0;
    for (; g + 4 <= g_rows; g += 4) {
        const float *w0 = w + g * stride, *w1 = w0 + stride, *w2 = w1 + stride, *w3 = w2 + stride;
        for (int64_t i = 0; i < d; i += VEC) {
            float *a = acc + g * d + i;
            vf a0 = load_f32(a), a1 = load_f32(a + d), a2 = load_f32(a + 2 * d);
            vf a3 = load_f32(a + 3 * d);
            for (int64_t t = 0; t < n; t++) {
                const vf vv = load_kv(v + t * slot, i, bf16, fp8);
                a0 += w0[t] * vv;
                a1 += w1[t] * vv;
                a2 += w2[t] * vv;
                a3 += w3[t] * vv;
            }
            store_f32(a, a0);
            store_f32(a + d, a1);
            store_f32(a + 2 * d, a2);
            store_f32(a + 3 * d, a3);
        }
    }
    for (; g < g_rows; g++)
        for (int64_t i = 0; i < d; i += VEC) {
            vf a = load_f32(acc + g * d + i);
            for (int64_t t = 0; t < n; t++)
                a += w[g * stride + t] * load_kv(v + t * slot, i, bf16, fp8);
            store_f32(acc + g * d + i, a);
        }
}

/* x rounded to the nearest bfloat16 (ties to even), kept as float. For finite x only. */
ALWAYS_INLINE vf round_bf16(vf x)
{
    const vu bits = (vu)x;
    return (vf)((bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u);
}

/* Folds `s` [rows, stride] scores (base 2; lanes past the page's tokens hold -inf) into each
 * row's running max `m`, denominator `l` and numerator `acc`, leaving the weights in `s`.
 * With a bfloat16 cache the weights left for V are rounded to bfloat16 (the denominator sums
 * them unrounded), as flash attention does on CUDA and on the CPU: the reference's numerics. */
ALWAYS_INLINE void softmax_page(float *restrict s, int64_t stride, int64_t rows, int64_t d,
                                float *restrict m, float *restrict l, float *restrict acc,
                                int bf16)
{
    for (int64_t r = 0; r < rows; r++) {
        float *restrict sr = s + r * stride;
        vf top = (vf){0} + m[r];
        for (int64_t t = 0; t < stride; t += VEC)
            top = max_lanes(top, load_f32(sr + t));
        const float mx = max_of(top);
        const float shrink = exp2f(m[r] - mx); /* 0 on the first page: m starts at -inf */
        vf sum = {0};
        for (int64_t t = 0; t < stride; t += VEC) {
            const vf w = exp2_lanes(load_f32(sr + t) - mx);
            store_f32(sr + t, bf16 ? round_bf16(w) : w);
            sum += w;
        }
        m[r] = mx;
        l[r] = l[r] * shrink + sum_lanes(sum);
        if (shrink != 1.0f)
            for (int64_t i = 0; i < d; i += VEC)
                store_f32(acc + r * d + i, load_f32(acc + r * d + i) * shrink);
    }
}

/* Tokens [t0, t1) of one page for kv heads [h0, h1), rows = (h1 - h0) * G query rows. Scores
 * visit K slot by slot, all heads of a slot together, prefetching the same slot of V; the V pass
 * goes head by head, prefetching that head's rows of the next page's K (`next_k`, NULL if none,
 * `next_n` visible slots), so memory stays busy in both passes. `s` holds [rows, stride]. */
ALWAYS_INLINE void
attend_page(const Problem *p, const char *k, const char *v, const char *next_k, int64_t next_n,
            int64_t t0, int64_t t1, int64_t h0, int64_t h1, const float *restrict qs,
            float *restrict acc, float *restrict m, float *restrict l, float *restrict s,
            int64_t stride, int bf16, int fp8)
{
    const int64_t g_rows = p->num_heads / p->num_kv_heads, d = p->head_dim;
    const int64_t esize = fp8 ? 1 : bf16 ? 2 : 4, rows = (h1 - h0) * g_rows, n = t1 - t0;
    const int64_t k_slot = p->k_strides[1] * esize, v_slot = p->v_strides[1] * esize;
    const int64_t k_head = p->k_strides[2] * esize, v_head = p->v_strides[2] * esize;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = n; t < stride; t++)
            s[r * stride + t] = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        prefetch_rows(v + (t0 + t) * v_slot + h0 * v_head, h1 - h0, v_head, d * esize, 1);
        for (int64_t h = h0; h < h1; h++) {
            const int64_t r = (h - h0) * g_rows;
            score_slot(qs + r * d, k + (t0 + t) * k_slot + h * k_head, d, g_rows,
                       s + r * stride + t, stride, bf16, fp8);
        }
    }
    /* Scores in base 2, exp(x * scale) == exp2(x * scale * log2(e)), fp8 K's scale included:
       on the scores, not folded into q, since q times a scale near float32's top overflows
       and infinity times a zero is NaN (where a softcap would have bounded the score). */
    const double factor = p->scale * LOG2E * (fp8 ? p->k_scale : 1.0);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < n; t++)
            s[r * stride + t] = (float)(s[r * stride + t] * factor);
    /* Gemma 2's cap, on base-2 scores: log2(e) * cap * tanh(s / cap) = cap2 * tanh(s2 / cap2). */
    if (p->softcap > 0) {
        const double cap = p->softcap * LOG2E;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t t = 0; t < n; t++)
                s[r * stride + t] = (float)(cap * tanhf((float)(s[r * stride + t] / cap)));
    }
    softmax_page(s, stride, rows, d, m, l, acc, p->bf16);
    for (int64_t h = h0; h < h1; h++) {
        const int64_t r = (h - h0) * g_rows;
        if (next_k)
            prefetch_rows(next_k + h * k_head, next_n, k_slot, d * esize, 0);
        accumulate_head(acc + r * d, v + t0 * v_slot + h * v_head, v_slot, n, d, g_rows,
                        s + r * stride, stride, bf16, fp8);
    }
}

/* Kv heads [h0, h1) of sequence b. `scratch` holds rows * (2 * head_dim + 2 + stride) floats,
 * rows = (h1 - h0) * G and stride = page_size rounded up to VEC. Returns 0, or -2 if the page
 * table names a page outside the cache. */
ALWAYS_INLINE int
decode_sequence(const Problem *p, int64_t b, int64_t h0, int64_t h1, float *scratch, int bf16,
                int fp8)
{
    const int64_t g_rows = p->num_heads / p->num_kv_heads, d = p->head_dim;
    const int64_t rows = (h1 - h0) * g_rows, size = p->page_size;
    const int64_t esize = fp8 ? 1 : bf16 ? 2 : 4;
    const int64_t stride = (size + VEC - 1) / VEC * VEC;
    const int64_t seq_len = p->seq_lens[b];
    const int64_t first = p->window > 0 && seq_len > p->window ? seq_len - p->window : 0;
    const int32_t *table = p->page_tables + b * p->table_stride;
    for (int64_t page = first / size; page * size < seq_len; page++)
        if (table[page] < 0 || table[page] >= p->num_pages)
            return -2;
    float *restrict qs = scratch, *restrict acc = qs + rows * d;
    float *restrict m = acc + rows * d, *restrict l = m + rows, *restrict s = l + rows;
    const int64_t q_offset = (b * p->num_heads + h0 * g_rows) * d;
    for (int64_t i = 0; i < rows * d; i++) {
        qs[i] = load_one(p->q, q_offset + i, bf16);
        acc[i] = 0.0f;
    }
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const char *k_pages = p->k_cache, *v_pages = p->v_cache;
    const int64_t k_page = p->k_strides[0] * esize, v_page = p->v_strides[0] * esize;
    for (int64_t page = first / size; page * size < seq_len; page++) {
        const int64_t start = page * size;
        const int64_t t0 = first > start ? first - start : 0;
        const int64_t t1 = seq_len - start < size ? seq_len - start : size;
        const int64_t next_n = seq_len - start - size < size ? seq_len - start - size : size;
        const char *next_k = next_n > 0 ? k_pages + table[page + 1] * k_page : NULL;
        attend_page(p, k_pages + table[page] * k_page, v_pages + table[page] * v_page, next_k,
                    next_n, t0, t1, h0, h1, qs, acc, m, l, s, stride, bf16, fp8);
    }
    for (int64_t r = 0; r < rows; r++) {
        float inv = (fp8 ? (float)p->v_scale : 1.0f) / l[r];
        if (p->sinks) { /* the sink's weight joins the denominator under the larger max */
            /* in base 2, at most FLT_MAX: infinity less infinity is NaN (NaN stays NaN) */
            const float scaled = p->sinks[h0 * g_rows + r] * LOG2E;
            const float sink = scaled > FLT_MAX ? FLT_MAX : scaled;
            const float top = sink > m[r] ? sink : m[r];
            const float shrink = exp2f(m[r] - top);
            inv = (fp8 ? (float)p->v_scale : 1.0f) * shrink
                  / (l[r] * shrink + exp2f(sink - top));
        }
        for (int64_t i = 0; i < d; i++) {
            const float x = acc[r * d + i] * inv;
            if (bf16)
                ((uint16_t *)p->out)[q_offset + r * d + i] = to_bf16(x);
            else
                ((float *)p->out)[q_offset + r * d + i] = x;
        }
    }
    return 0;
}

static void run_chunks(void *arg)
{
    Work *work = arg;
    const Problem *p = work->p;
    const int64_t kv = p->num_kv_heads, stride = (p->page_size + VEC - 1) / VEC * VEC;
    const int64_t floats = p->num_heads * (2 * p->head_dim + 2 + stride);
    float *scratch = malloc((size_t)floats * sizeof(float));
    int status = scratch ? 0 : -1;
    for (int64_t c; !status && (c = __atomic_fetch_add(&work->next, 1, __ATOMIC_RELAXED))
                                   < work->chunks;) {
        const int64_t b = c / work->parts, part = c % work->parts;
        const int64_t h0 = part * kv / work->parts, h1 = (part + 1) * kv / work->parts;
        if (p->fp8)
            status = p->bf16 ? decode_sequence(p, b, h0, h1, scratch, 1, 1)
                             : decode_sequence(p, b, h0, h1, scratch, 0, 1);
        else
            status = p->bf16 ? decode_sequence(p, b, h0, h1, scratch, 1, 0)
                             : decode_sequence(p, b, h0, h1, scratch, 0, 0);
    }
    free(scratch);
    if (status) /* any failure wins; which one does not matter */
        __atomic_store_n(&work->status, status, __ATOMIC_RELAXED);
}

static void *run_thread(void *work)
{
    run_chunks(work);
    return NULL;
}

/* libgomp's entry point for `#pragma omp parallel`: runs fn(data) on a team of num_threads. */
typedef void (*Parallel)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);

/* Runs every (sequence, kv head) item on num_threads threads, the calling one included: on the
 * team of `parallel` (the OpenMP runtime torch already runs, whose idle workers spin for a
 * while after each torch op and would otherwise compete for the cores), or on threads of our
 * own if it is NULL. Each sequence is cut into enough kv-head parts for about four chunks per
 * thread. Returns 0; -1 if out of memory; -2 if a page id is out of range. */
int kvpool_paged_decode(const Problem *p, int num_threads, Parallel parallel)
{
    if (p->batch < 1)
        return 0;
    if (num_threads > MAX_THREADS)
        num_threads = MAX_THREADS;
    if (num_threads < 1)
        num_threads = 1;
    int64_t parts = (4 * num_threads + p->batch - 1) / p->batch;
    parts = parts < p->num_kv_heads ? parts : p->num_kv_heads;
    Work work = {p, parts, p->batch * parts, 0, 0};
    if (num_threads > work.chunks)
        num_threads = (int)work.chunks;
    if (parallel && num_threads > 1) {
        parallel(run_chunks, &work, (unsigned)num_threads, 0);
        return work.status;
    }
    pthread_t threads[MAX_THREADS];
    int started = 1;
    while (started < num_threads && !pthread_create(&threads[started], NULL, run_thread, &work))
        started++;
    run_chunks(&work);
    for (int i = 1; i < started; i++)
        pthread_join(threads[i], NULL);
    return work.status;
}
