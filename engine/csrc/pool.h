/* pool_run(parts, fn, ctx) calls fn(ctx, part, parts) for part = 0 .. parts-1, each part on whichever
 * of the calling thread and the warm worker threads (pool.c) takes it first; returns when all are done. */
#ifndef PAGEDCHAT_POOL_H
#define PAGEDCHAT_POOL_H

#include <stdint.h>

typedef void (*pool_task)(void *ctx, int part, int parts);

void pool_run(int parts, pool_task fn, void *ctx);

/* The first item of part `part` when n items are shared evenly among `parts` (part = parts: n). */
static inline int64_t pool_share(int64_t n, int part, int parts) { return n * part / parts; }

#endif
