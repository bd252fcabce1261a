/* The SSD scan of a step's prefill spans as the plain recurrence, token after token, for CPU (mamba_prefill.py
 * builds and loads this file). Per span s (its tokens contiguous, spans one after the other from row 0), head h
 * (group g = h / (H / G)), channel p, token t of the span:
 *     S[h, p, :]  = exp(dt[t, h] A[h]) S[h, p, :] + dt[t, h] x[t, h, p] B[t, g, :]
 *     y[t, h, p]  = S[h, p, :] . C[t, g, :] + D[h] x[t, h, p]
 * starting from states[s] and leaving each span's final state there. One head's state (P x N floats, 16 KB at
 * 64 x 64) stays in L1 for the whole span, so each token costs one read and one write of it from cache, where
 * the chunked form's GEMMs are small and many. The state is held transposed ([N, P]) while the span runs, so
 * every multiply-add runs along p: the readout sums over n into P accumulators with no horizontal sums (with
 * the [P, N] rows each channel's dot product was one chain of dependent multiply-adds, 4x slower). When P is
 * 16, 32, 64 or 128 the P accumulators and dt x stay in vector registers (GCC/Clang vector extensions): with them
 * in memory every multiply-add also stored its accumulator, 1.8x the time; other P take a plain loop. When `chunk_states` is not NULL, the state before every
 * `chunk`-token chunk of each span is written there too ([chunks, H, P, N], span-major), as the chunked scan
 * returns it for the prefix cache's boundary states. The log-decay d A is clamped at `log_floor` first (exp() of
 * values below float32's normal range is slow and changes nothing next to the weight-1 terms). Heads [h0, h1) only, so callers may split the heads
 * between threads. All tensors float32 and contiguous. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

/* to [N, P] from [P, N] (forward != 0), or back */
static void transpose(float *dst, const float *src, int64_t P, int64_t N, int forward) {
    for (int64_t p = 0; p < P; p++) {
        for (int64_t n = 0; n < N; n++) {
            if (forward) dst[n * P + p] = src[p * N + n];
            else dst[p * N + n] = src[n * P + p];
        }
    }
}

/* One token of one head on the transposed state St [N, P]: St = decay St + B (dt x), y = St^T C + D x. */
static inline __attribute__((always_inline)) void token_vectors(float *St, const float *Bt, const float *Ct,
                                                                const float *xt, float *yt, float d, float decay,
                                                                float skip, int64_t N, const int PV) {
    v16 acc[8], dtx[8], xv;
    for (int j = 0; j < PV; j++) {
        memcpy(&xv, xt + 16 * j, sizeof xv);
        dtx[j] = xv * d;
        acc[j] = xv * skip;
    }
    for (int64_t n = 0; n < N; n++) {
        v16 *Sn = (v16 *)(St + n * 16 * PV);
        const float b = Bt[n], c = Ct[n];
        for (int j = 0; j < PV; j++) {
            const v16 v = Sn[j] * decay + dtx[j] * b;
            Sn[j] = v;
            acc[j] += v * c;
        }
    }
    for (int j = 0; j < PV; j++) memcpy(yt + 16 * j, &acc[j], sizeof acc[j]);
}

static void token_plain(float *St, const float *Bt, const float *Ct, const float *xt, float *yt, float d, float decay,
                        float skip, int64_t P, int64_t N, float *dtx) {
    for (int64_t p = 0; p < P; p++) {
        dtx[p] = d * xt[p];
        yt[p] = skip * xt[p];
    }
    for (int64_t n = 0; n < N; n++) {
        float *Sn = St + n * P;
        const float b = Bt[n], c = Ct[n];
        for (int64_t p = 0; p < P; p++) {
            const float v = Sn[p] * decay + b * dtx[p];
            Sn[p] = v;
            yt[p] += c * v;
        }
    }
}

int ssd_prefill_scan(const float *x, const float *dt, const float *A, const float *B, const float *C,
                     const float *D, float *states, const int64_t *lengths, int64_t S, int64_t H, int64_t P,
                     int64_t N, int64_t G, float *y, float *chunk_states, int64_t chunk, float log_floor, int64_t h0,
                     int64_t h1) {
    const int64_t heads_per_group = H / G, state = P * N;
    const int64_t bytes = (int64_t)sizeof(float) * (state + P + 15) / 64 * 64 + 64;
    float *St = aligned_alloc(64, (size_t)bytes);
    if (!St) return -1;
    float *dtx = St + state;
    int64_t row = 0, first_chunk = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t length = lengths[s];
        for (int64_t h = h0; h < h1; h++) {
            const int64_t g = h / heads_per_group;
            float *Sh = states + (s * H + h) * state;
            const float a = A[h], skip = D[h];
            transpose(St, Sh, P, N, 1);
            for (int64_t t = 0; t < length; t++) {
                const int64_t r = row + t;
                if (chunk_states && t % chunk == 0) {
                    transpose(chunk_states + ((first_chunk + t / chunk) * H + h) * state, St, P, N, 0);
                }
                const float d = dt[r * H + h], decay = expf(fmaxf(d * a, log_floor));
                const float *Bt = B + (r * G + g) * N, *Ct = C + (r * G + g) * N;
                const float *xt = x + (r * H + h) * P;
                float *yt = y + (r * H + h) * P;
                switch (P) {
                case 16: token_vectors(St, Bt, Ct, xt, yt, d, decay, skip, N, 1); break;
                case 32: token_vectors(St, Bt, Ct, xt, yt, d, decay, skip, N, 2); break;
                case 64: token_vectors(St, Bt, Ct, xt, yt, d, decay, skip, N, 4); break;
                case 128: token_vectors(St, Bt, Ct, xt, yt, d, decay, skip, N, 8); break;
                default: token_plain(St, Bt, Ct, xt, yt, d, decay, skip, P, N, dtx);
                }
            }
            transpose(Sh, St, P, N, 0);
        }
        row += length;
        first_chunk += (length + chunk - 1) / chunk;
    }
    free(St);
    return 0;
}

/* The causal depthwise conv of the same spans (the mixer's conv before its activation), each continuing from
 * its conv state row, as `packed_prefill.packed_causal_conv` computes it: per span s (pool row slots[s]),
 * token t, channel c,
 *     out[t, c] = bias[c] + sum_j taps[j, c] in[t - (K-1) + j, c]      (j = 0 .. K-1, in that order)
 * where in[u] is the span's token u, or for u < 0 the conv state's column K-1+u; then the state row holds the
 * last K-1 inputs. Each tap is one fused multiply-add, as torch's addcmul_ and F.conv1d do on these cores, so
 * the sums are F.conv1d's bit for bit, as packed_causal_conv's are. x: [T, C] rows `stride` floats apart; taps [K, C];
 * bias [C] or NULL; state [rows, C, K-1]; out [T, C] contiguous. Returns 0, or -1 (nothing written) when a
 * slot is outside [0, rows) or the scratch rows cannot be allocated. */
int causal_conv(const float *x, int64_t stride, const float *taps, const float *bias, float *state, int64_t rows,
                const int64_t *slots, const int64_t *lengths, int64_t S, int64_t C, int64_t K, float *out) {
    const int64_t keep = K - 1;
    for (int64_t s = 0; s < S; s++) {
        if (slots[s] < 0 || slots[s] >= rows) return -1;
    }
    /* per span: its state as rows [keep, C], then its first min(L, keep) tokens */
    float *head = malloc(sizeof(float) * (size_t)(2 * keep * C + 1));
    if (!head) return -1;
    int64_t row = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t length = lengths[s];
        float *st = state + slots[s] * C * keep;
        for (int64_t k = 0; k < keep; k++) {
            for (int64_t c = 0; c < C; c++) head[k * C + c] = st[c * keep + k];
        }
        for (int64_t k = 0; k < keep && k < length; k++) {
            memcpy(head + (keep + k) * C, x + (row + k) * stride, sizeof(float) * (size_t)C);
        }
        for (int64_t t = 0; t < length; t++) {
            float *o = out + (row + t) * C;
            if (bias) memcpy(o, bias, sizeof(float) * (size_t)C);
            else memset(o, 0, sizeof(float) * (size_t)C);
            for (int64_t j = 0; j < K; j++) {
                const int64_t u = t - keep + j; /* the input's token within the span */
                const float *in = t < keep ? head + (u + keep) * C : x + (row + u) * stride;
                const float *w = taps + j * C;
#pragma omp simd
                for (int64_t c = 0; c < C; c++) o[c] = fmaf(w[c], in[c], o[c]);
            }
        }
        for (int64_t k = 0; k < keep; k++) { /* the last keep inputs of [state, tokens] */
            const int64_t u = length - keep + k;
            const float *src = u < 0 ? head + (u + keep) * C : x + (row + u) * stride;
            for (int64_t c = 0; c < C; c++) st[c * keep + k] = src[c];
        }
        row += length;
    }
    free(head);
    return 0;
}
