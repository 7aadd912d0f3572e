/* The threads our kernels split their work over, kept warm between the calls of one model step.
 *
 * OpenMP cannot do this here: with OMP_WAIT_POLICY=PASSIVE (which the engine needs, see
 * engine/__init__.py) waking a sleeping thread costs ~50 us a parallel region, more than a
 * few-row matmul takes, and with spinning threads our libgomp and torch's fought over the two
 * cores. These workers spin briefly after each job (the next kernel of a step follows within
 * microseconds), yielding the core to any other runnable thread while they do, then sleep on a
 * futex until the next job. Measured on 120 linears of 8 rows: one thread 11.1 ms, two 6.6.
 *
 * The parts of a job are taken in turn by whichever thread comes first, the caller too: where another
 * process (or the server's own thread) holds a core, a worker that is not running takes none, and the
 * caller does its share instead of waiting for it to be scheduled. Measured (Zen 5, 2 cores, the default
 * model, a busy process beside): decode steps at 1 and 32 sessions took 2.7x their time alone with each
 * part bound to its thread, 1.5x and 1.8x with parts taken in turn (alone: the same or faster). Which
 * thread runs a part changes nothing in its result.
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
    _Atomic uint64_t claim; /* the job's generation << 32 | the next part to take */
    atomic_int finished;    /* parts of the current job done */
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

/* Takes and runs parts of job `generation` until none is left (or a later job has begun). A part is
 * taken by moving `claim` on from (generation, part): that only succeeds while the job has a part not
 * taken, so it is not finished and its fn, ctx and parts, read before, are still the ones published. */
static void take_parts(unsigned generation) {
    for (;;) {
        uint64_t claim = atomic_load(&pool.claim);
        const pool_task fn = pool.fn;
        void *const ctx = pool.ctx;
        const int parts = pool.parts, part = (int)(uint32_t)claim;
        if ((unsigned)(claim >> 32) != generation || part >= parts) return;
        if (atomic_compare_exchange_weak(&pool.claim, &claim, claim + 1)) {
            fn(ctx, part, parts);
            atomic_fetch_add(&pool.finished, 1);
        }
    }
}

static void *worker(void *arg) {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals are Python's main thread's business */
    unsigned seen = (unsigned)(uintptr_t)arg; /* the generation before its first job */
    for (;;) {
        seen = wait_for_job(seen);
        take_parts(seen);
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
        const uintptr_t arg = atomic_load(&pool.generation);
        const int failed = pthread_create(&t, &attr, worker, (void *)arg);
        pthread_attr_destroy(&attr);
        if (failed) break;
    }
    return pool.workers;
}

void pool_run(int parts, pool_task fn, void *ctx) {
    if (parts > 1 && pthread_mutex_trylock(&pool.lock) == 0) {
        if (start_workers(parts - 1) >= parts - 1) {
            const unsigned generation = atomic_load(&pool.generation) + 1;
            pool.fn = fn, pool.ctx = ctx, pool.parts = parts;
            atomic_store(&pool.finished, 0);
            atomic_store(&pool.claim, (uint64_t)generation << 32);
            atomic_store(&pool.generation, generation);
            if (atomic_load(&pool.sleepers)) futex(&pool.generation, FUTEX_WAKE, INT_MAX);
            take_parts(generation);
            for (int spins = 1; atomic_load(&pool.finished) < parts; spins++) {
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
