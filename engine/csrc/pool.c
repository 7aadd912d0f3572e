/* The threads our kernels split their work over, kept warm between the calls of one model step.
 *
 * OpenMP cannot do this here: with OMP_WAIT_POLICY=PASSIVE (which the engine needs, see
 * engine/__init__.py) waking a sleeping thread costs ~50 us a parallel region, more than a
 * few-row matmul takes, and with spinning threads our libgomp and torch's fought over the two
 * cores. These workers spin briefly after each job (the next kernel of a step follows within
 * microseconds), yielding the core to any other runnable thread while they do, then sleep on a
 * futex until the next job. Measured on 120 linears of 8 rows: one thread 11.1 ms, two 6.6.
 *
 * One job runs at a time: a caller that finds the pool busy (another Python thread's kernel) runs
 * its parts itself, in order. After fork() the child starts without workers.
 */
#define _GNU_SOURCE
#include "pool.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 63
#define SPIN_NS 200000 /* how long an idle worker stays awake for the next job */

static struct {
    pthread_mutex_t lock;
    int workers;
    pool_task fn;
    void *ctx;
    int parts;
    atomic_uint generation; /* bumped once per job; workers sleep on it */
    atomic_int done;        /* workers finished with the current job */
    atomic_int sleepers;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void futex(atomic_uint *addr, int op, unsigned value) {
    syscall(SYS_futex, (unsigned *)addr, op | FUTEX_PRIVATE_FLAG, value, NULL, NULL, 0);
}

static unsigned wait_for_job(unsigned seen) {
    int64_t start = now_ns();
    for (int spins = 0;; spins++) {
        unsigned g = atomic_load(&pool.generation);
        if (g != seen) return g;
        if ((spins & 63) == 63) {
            if (now_ns() - start > SPIN_NS) {
                atomic_fetch_add(&pool.sleepers, 1);
                futex(&pool.generation, FUTEX_WAIT, seen); /* returns at once if a job came meanwhile */
                atomic_fetch_sub(&pool.sleepers, 1);
                start = now_ns();
            } else {
                sched_yield(); /* a runnable thread (torch's, the server's) gets this core first */
            }
        }
        __builtin_ia32_pause();
    }
}

static void *worker(void *arg) {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals are Python's main thread's business */
    const int id = (int)((uintptr_t)arg >> 32);
    unsigned seen = (unsigned)(uintptr_t)arg; /* the generation before its first job */
    for (;;) {
        seen = wait_for_job(seen);
        if (id < pool.parts) pool.fn(pool.ctx, id, pool.parts);
        atomic_fetch_add(&pool.done, 1);
    }
    return NULL;
}

static void forget_workers(void) { pool.workers = 0; } /* a forked child has none */

static void on_fork(void) { pthread_atfork(NULL, NULL, forget_workers); }

static int start_workers(int wanted) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, on_fork);
    for (; pool.workers < wanted && pool.workers < MAX_WORKERS; pool.workers++) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const uintptr_t arg = (uintptr_t)(pool.workers + 1) << 32 | atomic_load(&pool.generation); /* id, generation */
        const int failed = pthread_create(&t, &attr, worker, (void *)arg);
        pthread_attr_destroy(&attr);
        if (failed) break;
    }
    return pool.workers;
}

void pool_run(int parts, pool_task fn, void *ctx) {
    if (parts > 1 && pthread_mutex_trylock(&pool.lock) == 0) {
        if (start_workers(parts - 1) >= parts - 1) {
            pool.fn = fn, pool.ctx = ctx, pool.parts = parts;
            atomic_store(&pool.done, 0);
            atomic_fetch_add(&pool.generation, 1);
            if (atomic_load(&pool.sleepers)) futex(&pool.generation, FUTEX_WAKE, INT_MAX);
            fn(ctx, 0, parts);
            for (int spins = 1; atomic_load(&pool.done) < pool.workers; spins++) {
                if (!(spins & 63)) sched_yield();
                __builtin_ia32_pause();
            }
            pthread_mutex_unlock(&pool.lock);
            return;
        }
        pthread_mutex_unlock(&pool.lock);
    }
    for (int part = 0; part < parts; part++) fn(ctx, part, parts);
}
