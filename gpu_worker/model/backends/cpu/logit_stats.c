/* Per row of float32 logits: the first maximal index and the log-normaliser log(sum(exp(logit))), for the
 * sampler's plain rows (logit_stats.py builds and loads this file). Each row is read three times while it
 * stays in cache: its maximum (block by block), the first index holding it (searched in the first block
 * that holds the maximum), and sum(exp(logit - max)), sixteen lanes at a time (GCC/Clang vector
 * extensions: AVX-512 or AVX2 registers, whatever -march=native gives), each lane's
 * partial sums added in double every BLOCK logits (so a 100k-vocabulary row sums as accurately as torch's
 * log_softmax). A row whose maximum is -inf (every token masked out) gets index 0 and -inf; a NaN logit
 * is never the maximum. `rows` rows of `vocab` logits, `stride` floats apart; writes argmax[rows] and
 * lse[rows]. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 1024
#define WIDTH 16

typedef float floats __attribute__((vector_size(WIDTH * sizeof(float))));
typedef int32_t ints __attribute__((vector_size(WIDTH * sizeof(int32_t))));

/* exp(x) for x <= 0, within 2e-7 relative: x = n ln2 + r with n rounded to nearest (the 1.5 * 2^23 trick,
 * which leaves n in the low bits of t) and |r| <= ln2 / 2 (ln2 in two parts, so r is exact), e^r by its
 * Taylor polynomial of degree 7, 2^n by the exponent bits. Below -87 (e^-87 ~ 1.6e-38, near the smallest
 * normal float) it returns e^-87. */
static inline floats exp_nonpositive(floats x) {
    const floats low = {0};
    const floats floor_value = low - 87.0f;
    const ints below = x < floor_value;
    x = (floats)(((ints)x & ~below) | ((ints)floor_value & below));
    const floats magic = low + 12582912.0f;
    const floats t = x * 1.44269504088896341f + magic;
    const floats n = t - magic;
    const floats r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    floats p = low + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const ints exponent = ((ints)t - (ints)magic + 127) << 23;
    return p * (floats)exponent;
}

static float exp_nonpositive_one(float x) {
    floats v = {0};
    v[0] = x;
    return exp_nonpositive(v)[0];
}

void logit_stats(const float *logits, int64_t rows, int64_t vocab, int64_t stride, int64_t *argmax,
                 float *lse) {
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * stride;
        float m = -INFINITY;
        int64_t first_block = 0;  /* the first block holding the maximum: only it is searched for the index */
        for (int64_t start = 0; start < vocab; start += BLOCK) {
            const int64_t end = start + BLOCK <= vocab ? start + BLOCK : vocab;
            float block_max = -INFINITY;
#pragma omp simd reduction(max : block_max)
            for (int64_t i = start; i < end; i++) block_max = x[i] > block_max ? x[i] : block_max;
            if (block_max > m) {
                m = block_max;
                first_block = start;
            }
        }
        int64_t at = first_block;
        while (at < vocab && x[at] != m) at++;
        argmax[r] = at < vocab ? at : 0;
        if (m == -INFINITY) {
            lse[r] = -INFINITY;
            continue;
        }
        const floats mv = (floats){0} + m;
        double total = 0.0;
        int64_t i = 0;
        while (i + WIDTH <= vocab) {
            floats sum = {0};
            const int64_t end = i + BLOCK <= vocab ? i + BLOCK : vocab;
            for (; i + WIDTH <= end; i += WIDTH) {
                floats v;
                memcpy(&v, x + i, sizeof v);
                sum += exp_nonpositive(v - mv);
            }
            for (int l = 0; l < WIDTH; l++) total += sum[l];
        }
        for (; i < vocab; i++) total += exp_nonpositive_one(x[i] - m);
        lse[r] = m + (float)log(total);
    }
}
