/* 16-lane fp32 vectors and the helpers our kernels share (specdec, Apache-2.0): GCC/Clang vector
   extensions, compiled to AVX-512, AVX2 or NEON code as the CPU has. */

#ifndef SPECDEC_VEC16_H
#define SPECDEC_VEC16_H

#include <stdint.h>
#include <string.h>

/* 16 fp32 lanes (GCC/Clang vector extensions: AVX-512, AVX2 or NEON code as the CPU has) */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint32_t u16w __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32), aligned(2)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
#define LANES 16

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

/* LANES values at src (bf16 when bf16 != 0, else fp32) */
static inline v16 load16(const char *src, int bf16) {
    if (bf16) {
        h16 h;
        memcpy(&h, src, sizeof h);
        u16w wide = __builtin_convertvector(h, u16w) << 16;
        v16 f;
        memcpy(&f, &wide, sizeof f);
        return f;
    }
    v16 f;
    memcpy(&f, src, sizeof f);
    return f;
}

/* the first n (< LANES) values at src, the other lanes 0 */
static inline v16 load_part(const char *src, int64_t n, int bf16) {
    char buffer[64] = {0};
    memcpy(buffer, src, (size_t)(n * (bf16 ? 2 : 4)));
    return load16(buffer, bf16);
}

/* whether any lane of a comparison's result (each lane all ones or zero) is set: one test, where
   a loop over the lanes compiles to sixteen extractions */
static inline int any16(i16 mask) {
    typedef int32_t i8 __attribute__((vector_size(32)));
    i8 low, high;
    memcpy(&low, &mask, sizeof low);
    memcpy(&high, (const char *)&mask + sizeof low, sizeof high);
    low |= high;
    uint64_t words[4];
    memcpy(words, &low, sizeof words);
    return (words[0] | words[1] | words[2] | words[3]) != 0;
}

/* the lanes' sum, halves added pairwise: one fixed order */
static inline float total16(v16 x) {
    v8 a, b;
    memcpy(&a, &x, sizeof a);
    memcpy(&b, (const char *)&x + sizeof a, sizeof b);
    a += b;
    v4 c, d;
    memcpy(&c, &a, sizeof c);
    memcpy(&d, (const char *)&a + sizeof c, sizeof d);
    c += d;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* a * b + c rounded once, lane by lane, whatever the compiler would contract: code that must give
   the same bits along two paths (a key scored with 15 others or alone) says so here, where
   -ffp-contract=fast leaves each `a * b + c` to the compiler's choice, site by site */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline v16 fma16(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#elif defined(__FMA__)
#include <immintrin.h>
static inline v16 fma16(v16 a, v16 b, v16 c) {
    v8 x[2], y[2], z[2];
    memcpy(x, &a, sizeof x), memcpy(y, &b, sizeof y), memcpy(z, &c, sizeof z);
    for (int h = 0; h < 2; h++) z[h] = (v8)_mm256_fmadd_ps((__m256)x[h], (__m256)y[h], (__m256)z[h]);
    memcpy(&c, z, sizeof c);
    return c;
}
#elif defined(__ARM_FEATURE_FMA) && defined(__ARM_NEON)
#include <arm_neon.h>
static inline v16 fma16(v16 a, v16 b, v16 c) {
    float32x4_t x[4], y[4], z[4];
    memcpy(x, &a, sizeof x), memcpy(y, &b, sizeof y), memcpy(z, &c, sizeof z);
    for (int h = 0; h < 4; h++) z[h] = vfmaq_f32(z[h], x[h], y[h]);
    memcpy(&c, z, sizeof c);
    return c;
}
#elif defined(__FP_FAST_FMAF)
/* another CPU with a fused multiply-add (ppc64le, s390x, riscv64): lane by lane, each one fused */
static inline v16 fma16(v16 a, v16 b, v16 c) {
    for (int l = 0; l < LANES; l++) c[l] = __builtin_fmaf(a[l], b[l], c[l]);
    return c;
}
#else
/* no fused multiply-add on this CPU: nothing to contract to, each product rounded */
static inline v16 fma16(v16 a, v16 b, v16 c) { return a * b + c; }
#endif

/* two vectors' lanes picked by index (0-15: a's, 16-31: b's) */
#if defined(__clang__)
#define SHUFFLE16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE16(a, b, ...) __builtin_shuffle(a, b, (i16){__VA_ARGS__})
#endif

/* total16 of sixteen vectors at once: lane j of the result is total16(x[j]), bit for bit but a
   NaN's payload (the same additions of the same pairs, arranged across vectors: 45 vector
   operations, not 16 reductions, where the CPU has 512-bit vectors) */
static inline v16 totals16(const v16 x[16]) {
    v16 y[8], z[4], s[2];
    for (int p = 0; p < 8; p++)  /* halves: lanes i and i + 8 of each vector */
        y[p] = SHUFFLE16(x[2 * p], x[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SHUFFLE16(x[2 * p], x[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int r = 0; r < 4; r++)  /* quarters: lanes i and i + 4 of each half */
        z[r] = SHUFFLE16(y[2 * r], y[2 * r + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + SHUFFLE16(y[2 * r], y[2 * r + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int t = 0; t < 2; t++)  /* c0 + c2 and c1 + c3 of each quarter */
        s[t] = SHUFFLE16(z[2 * t], z[2 * t + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + SHUFFLE16(z[2 * t], z[2 * t + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE16(s[0], s[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SHUFFLE16(s[0], s[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* e^x for x <= 0, lane by lane: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor
   polynomial (relative error under 2e-7); x below -87 gives 2^-126's neighbourhood, not 0 */
static inline v16 exp16(v16 x) {
    const i16 low = x < -87.0f;  /* lanes all ones where true */
    const v16 floor = (v16){0} - 87.0f;
    x = (v16)(((i16)x & ~low) | ((i16)floor & low));
    const v16 shifted = x * 1.44269504f + 12582912.0f;  /* round to nearest by the fp32 ulp at 2^23 */
    const v16 n = shifted - 12582912.0f;
    const v16 r = (x - n * 0.693145751953125f) - n * 1.42860677e-6f;
    v16 p = r * (1.0f / 720) + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const i16 exponent = (__builtin_convertvector(n, i16) + 127) << 23;
    v16 scale;
    memcpy(&scale, &exponent, sizeof scale);
    return p * scale;
}

/* the lanes of x rounded to bf16 (kept as fp32 values), to nearest, ties to even (NaN stays NaN) */
static inline v16 round_bf16(v16 x) {
    u16w u;
    memcpy(&u, &x, sizeof u);
    const u16w nan = (u16w)((u & 0x7fffffffu) > 0x7f800000u);
    const u16w rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    u = (rounded & ~nan) | ((u | 0x400000u) & 0xffff0000u & nan);
    memcpy(&x, &u, sizeof x);
    return x;
}

/* n (<= LANES) lanes of x, rounded to bf16 already, stored as bf16 at dst */
static inline void store_bf16(uint16_t *dst, v16 x, int64_t n) {
    u16w u;
    memcpy(&u, &x, sizeof u);
    const h16 h = __builtin_convertvector(u >> 16, h16);
    if (n == LANES) memcpy(dst, &h, sizeof h);  /* a constant size: one store, not a call */
    else memcpy(dst, &h, (size_t)n * sizeof(uint16_t));
}

#endif
