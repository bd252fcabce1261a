/* The SSM state's decode update in place, for the compiled decode programs (ssm_update.py builds and loads
 * this file). Per row i of the decode group, pool row s = slots[i], head h (group g), channel p:
 *     y[i, h, p]    = decay[i, h] (S[s, h, p] . C[i, g]) + dt[i, h] x[i, h, p] (B[i, g] . C[i, g]) + D[h] x[i, h, p]
 *     S[s, h, p, :] = decay[i, h] S[s, h, p, :] + dt[i, h] x[i, h, p] B[i, g]
 * read off the old state and written over it in one pass. A slot that a later row also names is read but
 * not written: the compiled programs pad a bucket with copies of its first real row, placed before it, and
 * only that real row advances the state. All tensors float32, contiguous; S's `num_rows` rows `row_stride`
 * apart. Returns 0, or -1 (nothing read or written) when a slot is outside [0, num_rows). */
#include <stdint.h>

int ssm_decode_update(float *ssm, int64_t num_rows, int64_t row_stride, const int64_t *slots, int64_t b, int64_t H,
                      int64_t P, int64_t N, int64_t G, const float *x, const float *dt, const float *decay,
                      const float *B, const float *C, const float *D, float *y) {
    const int64_t heads_per_group = H / G;
    for (int64_t i = 0; i < b; i++) {
        if (slots[i] < 0 || slots[i] >= num_rows) return -1;
    }
    for (int64_t i = 0; i < b; i++) {
        const int64_t slot = slots[i];
        int write = 1;
        for (int64_t j = i + 1; j < b; j++) {
            if (slots[j] == slot) {
                write = 0;
                break;
            }
        }
        float *row = ssm + slot * row_stride;
        for (int64_t h = 0; h < H; h++) {
            const int64_t g = h / heads_per_group;
            const float *Bg = B + (i * G + g) * N, *Cg = C + (i * G + g) * N;
            const float dA = decay[i * H + h], dth = dt[i * H + h];
            float bc = 0.f;
#pragma omp simd reduction(+ : bc)
            for (int64_t n = 0; n < N; n++) bc += Bg[n] * Cg[n];
            for (int64_t p = 0; p < P; p++) {
                float *S = row + (h * P + p) * N;
                const float xv = x[(i * H + h) * P + p], dtx = dth * xv;
                float acc = 0.f;
                if (write) {
#pragma omp simd reduction(+ : acc)
                    for (int64_t n = 0; n < N; n++) {
                        const float s = S[n];
                        acc += s * Cg[n];
                        S[n] = s * dA + dtx * Bg[n];
                    }
                } else {
#pragma omp simd reduction(+ : acc)
                    for (int64_t n = 0; n < N; n++) acc += S[n] * Cg[n];
                }
                y[(i * H + h) * P + p] = dA * acc + dtx * bc + D[h] * xv;
            }
        }
    }
    return 0;
}
