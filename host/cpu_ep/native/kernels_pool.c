/* A persistent worker pool for the packed GEMM and attention; #included by kernels_gemm.c, hashed with
 * kernels.c by build_info.
 *
 * Why not a thread per call: a product split statically between the caller and threads started for it
 * returns when the slowest part is done, so on a machine whose other cores are busy every product waited
 * for a new thread's first scheduler slice (the zoo transformer's p50 swung 3x between repeats). Here, as in
 * onnxruntime's pool, the workers are started once and sleep between products, and the work is a list of
 * units claimed one at a time from a shared counter by the caller and by every worker that wakes in time:
 * a worker that is not scheduled leaves its units to the others, the caller included, instead of holding
 * the product up. Each unit computes whole outputs, so results do not depend on who computed them.
 *
 * Workers sleep as soon as no unit is left (a condition variable): spinning for the next job for 50-400 us
 * was tried, and on the shared 2-core machine it gained ~15% idle but lost as much, and doubled the
 * swings, with one other busy process beside it (issue 28's condition).
 *
 * One product at a time uses the pool: a second thread that finds it busy (another session's run) computes
 * its product alone rather than oversubscribe the cores. A forked child starts with no workers. */

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>

#define POOL_MAX_WORKERS 63

/* A worker descheduled in the middle of a unit holds the product up for the rest of its time slice
 * (milliseconds), which no claiming order avoids: with another busy process on a 2-core machine that is
 * most products, and the run's p50 swung 1.6-1.8x between repeats (issue 28). A wait for workers longer
 * than POOL_STRAGGLER_NS, and longer than the caller's own share took, marks one; the next
 * `pool.backoff` products then run on the calling thread alone, a count that doubles while stragglers
 * recur (up to POOL_BACKOFF_MAX) and starts again from POOL_BACKOFF_MIN after a product without one. */
#define POOL_STRAGGLER_NS 100000
#define POOL_BACKOFF_MIN 16
#define POOL_BACKOFF_MAX 4096

typedef void (*PoolUnit)(const void *job, int unit);

typedef struct {
    pthread_mutex_t lock; /* guards every field below but `next` */
    pthread_cond_t wake;  /* workers: a new job (gen changed) */
    pthread_cond_t idle;  /* the caller: the last worker left the job */
    int workers;          /* started */
    unsigned long gen;    /* counts jobs */
    PoolUnit fn;          /* the current job: NULL between jobs */
    const void *job;
    int units, wanted, joined, inside;
    int next;    /* the next unit to claim (atomic) */
    int backoff; /* products to run alone after the last straggler (see POOL_STRAGGLER_NS) */
    int skip;    /* of those, how many are left (under pool_busy) */
} Pool;

static Pool pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, NULL,
                    NULL, 0, 0, 0, 0, 0, 0, 0};
static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER; /* held by the product that uses the pool */
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void pool_claim(PoolUnit fn, const void *job, int units) {
    for (int u; (u = __atomic_fetch_add(&pool.next, 1, __ATOMIC_RELAXED)) < units;) fn(job, u);
}

/* `start` is the job count when the worker was started (under pool.lock, before the job that asked for it):
 * that job is new to it. */
static void *pool_worker(void *start) {
    unsigned long seen = (unsigned long)(uintptr_t)start;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.gen == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.gen;
        if (pool.fn == NULL || pool.joined >= pool.wanted) continue; /* over, or enough hands already */
        pool.joined++;
        pool.inside++;
        PoolUnit fn = pool.fn;
        const void *job = pool.job;
        int units = pool.units;
        pthread_mutex_unlock(&pool.lock);
        pool_claim(fn, job, units);
        pthread_mutex_lock(&pool.lock);
        if (--pool.inside == 0) pthread_cond_signal(&pool.idle);
    }
    return NULL;
}

/* In a forked child only the forking thread exists: forget the workers, unlock what the parent held. */
static void pool_after_fork(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
    pool.lock = pool_busy = fresh;
    pool.wake = pool.idle = cond;
    pool.workers = pool.joined = pool.inside = pool.wanted = 0;
    pool.backoff = pool.skip = 0; /* the parent's stragglers are not the child's */
    pool.fn = NULL;
}

/* Once, before the first worker: a forked child forgets the workers, and this library stays mapped while
 * they live (they sleep inside its code), whatever the caller does with its own handle: cffi closes a
 * library once nothing references it, and tests open copies of it. */
static void pool_init(void) {
    pthread_atfork(NULL, NULL, pool_after_fork);
    Dl_info info;
    if (dladdr((void *)&pool_init, &info) && info.dli_fname)
        dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD | RTLD_NODELETE);
}

/* Start workers until there are `n` (or as many as could be started); under pool.lock. Workers block
 * every signal: Python's handlers run on its main thread. */
static void pool_grow(int n) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    while (pool.workers < n) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&id, &attr, pool_worker, (void *)(uintptr_t)pool.gen);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.workers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static int64_t pool_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* After a pooled product: how long the caller claimed units, then waited for the workers still in one. */
static void pool_note_wait(int64_t claimed_ns, int64_t waited_ns) {
    if (waited_ns > POOL_STRAGGLER_NS && waited_ns > claimed_ns) {
        pool.backoff = pool.backoff ? (pool.backoff * 2 < POOL_BACKOFF_MAX ? pool.backoff * 2 : POOL_BACKOFF_MAX)
                                    : POOL_BACKOFF_MIN;
        pool.skip = pool.backoff;
    } else {
        pool.backoff = 0;
    }
}

/* Run fn(job, u) for u in 0..units-1 on the calling thread and at most `helpers` pool workers; returns when
 * every unit is done. */
static void pool_run(PoolUnit fn, const void *job, int units, int helpers) {
    if (helpers > POOL_MAX_WORKERS) helpers = POOL_MAX_WORKERS;
    if (helpers < 1 || units < 2 || pthread_mutex_trylock(&pool_busy) != 0) {
        for (int u = 0; u < units; u++) fn(job, u);
        return;
    }
    if (pool.skip > 0) { /* backing off after a straggler: alone */
        pool.skip--;
        pthread_mutex_unlock(&pool_busy);
        for (int u = 0; u < units; u++) fn(job, u);
        return;
    }
    pthread_once(&pool_once, pool_init);
    pthread_mutex_lock(&pool.lock);
    pool_grow(helpers);
    pool.fn = fn;
    pool.job = job;
    pool.units = units;
    pool.wanted = helpers < pool.workers ? helpers : pool.workers;
    pool.joined = 0;
    __atomic_store_n(&pool.next, 0, __ATOMIC_RELAXED);
    pool.gen++;
    /* as many as may join: a pool grown by a session of more threads keeps its other workers asleep (a
     * worker still awake from the last job sees the new one before it waits) */
    for (int i = 0; i < pool.wanted; i++) pthread_cond_signal(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    int64_t start = pool_now_ns();
    pool_claim(fn, job, units);
    int64_t claimed = pool_now_ns();
    pthread_mutex_lock(&pool.lock);
    pool.fn = NULL; /* every unit is claimed: a worker that wakes from now on stays out */
    while (pool.inside > 0) pthread_cond_wait(&pool.idle, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    pool_note_wait(claimed - start, pool_now_ns() - claimed);
    pthread_mutex_unlock(&pool_busy);
}

/* Tests: how many products are left to run alone after a straggler, and the policy of pool_note_wait
 * applied as a pooled product that claimed for `claimed_ns` and then waited `waited_ns` would. */
int ep_pool_skip(void) { return pool.skip; }

void ep_pool_note(long long claimed_ns, long long waited_ns) {
    pthread_mutex_lock(&pool_busy);
    pool_note_wait(claimed_ns, waited_ns);
    pthread_mutex_unlock(&pool_busy);
}

/* How many workers the pool has started (tests: a product's threads are the pool's, not new ones). */
int ep_pool_workers(void) {
    pthread_mutex_lock(&pool.lock);
    int n = pool.workers;
    pthread_mutex_unlock(&pool.lock);
    return n;
}
