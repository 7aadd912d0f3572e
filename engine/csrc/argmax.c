/* The index of each row's first maximum of a float32 matrix, as torch.argmax (a NaN counts as the
 * maximum; the first one wins). torch's max(dim) took 1.3-2.5 ms for greedy decoding's 64 rows of a
 * 49152-token vocabulary here; a vectorised pass for the maximum and a short one for its first
 * position take a fraction of that.
 *
 * x [rows, n] contiguous, out [rows] int64.
 */
#include <math.h>
#include <stdint.h>

#include "common.h"
#include "kernels.h"
#include "pool.h"

struct job {
    const float *x;
    int64_t *out, rows, n;
};

static void argmax_part(void *ctx, int part, int parts) {
    const struct job *j = ctx;
    const int64_t n = j->n;
    for (int64_t r = pool_share(j->rows, part, parts), last = pool_share(j->rows, part + 1, parts); r < last; r++) {
        const float *row = j->x + r * n;
        float m = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < n; i++) {
            m = row[i] > m ? row[i] : m;
            nan |= row[i] != row[i];
        }
        int64_t at = 0;
        for (int64_t i0 = 0; i0 < n; i0 += 256) { /* the first 256-wide span holding it, then scalar */
            const int64_t end = i0 + 256 < n ? i0 + 256 : n;
            int hit = 0;
#pragma omp simd reduction(| : hit)
            for (int64_t i = i0; i < end; i++) hit |= nan ? row[i] != row[i] : row[i] == m;
            if (hit) {
                for (at = i0; at < end - 1 && (nan ? !isnan(row[at]) : row[at] != m); at++) {}
                break;
            }
        }
        j->out[r] = at;
    }
}

void argmax_rows(const float *x, int64_t *out, int64_t rows, int64_t n, int threads) {
    struct job j = {x, out, rows, n};
    pool_run(rows * n < (1 << 18) ? 1 : rows < threads ? (int)rows : threads, argmax_part, &j);
}
