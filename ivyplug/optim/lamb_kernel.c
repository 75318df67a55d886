/*
 * ivyplug's compiled LAMB step for contiguous float32 CPU tensors (loaded by ivyplug/optim/compiled_kernel.py).
 *
 * Plain C11 and pthreads, no torch headers, so that it builds in about a second with the system compiler. The
 * threads are the OpenMP team torch already runs on when the process has an OpenMP runtime (see run_threads),
 * else pthreads of its own.
 *
 * Per tensor, two passes instead of the torch kernel's five or six:
 *   pass 1 reads x, g, m, v; writes m, v; sums |x|^2 and |u|^2 with u = c*m/(sqrt(v)+eps') + wd*x,
 *   pass 2 writes x -= lr*ratio*u, last block first, so that it starts on what pass 1 left in cache; u comes from
 *   a scratch buffer small enough to stay in cache while it has room, else it is recomputed from m, v, x
 *   (cheaper than a round trip through memory).
 * With layer adaptation off the ratio is 1 and one pass does it all. c = sqrt(1-beta2^t)/(1-beta1^t) and
 * eps' = eps*sqrt(1-beta2^t) give c*m/(sqrt(v)+eps') = m_hat/(sqrt(v_hat)+eps).
 *
 * Threads: tensors of at least split_min elements per thread are cut into blocks of about `block` elements
 * (a multiple of the thread count) that the threads claim as they go, so a thread the OS preempts on a busy
 * machine holds up no one for long; pass 2 runs over the blocks a thread took in pass 1, which are in its cache,
 * with u kept in that thread's part of the scratch while there is room. Smaller tensors are claimed whole. Norms
 * are summed in double per block and the blocks combined in order: results depend on the thread count, never on
 * scheduling. The trust ratio rule is the Python one: ||x||/||u||
 * clipped to [min_ratio, max_ratio], exactly 1 when either norm is 0 or not finite.
 */
#define _GNU_SOURCE /* RTLD_DEFAULT and RTLD_NOLOAD in glibc's dlfcn.h */
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define IVY_MAX_THREADS 256
#define IVY_WALK 4096 /* elements per step of pass 2's backward walk over a whole tensor */
#define IVY_SPIN 256    /* busy-wait rounds before a waiting thread starts yielding the core */
#define IVY_SLACK 1024 /* floats of room per kept block, to place it clear of the other streams (kept_at) */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Sense-reversing barrier: spins briefly, then yields, so a loaded machine gets the core back. The team size is
 * passed by each thread (it is known only once the team has started). */
typedef struct {
    atomic_int count;
    atomic_int sense;
} barrier_t;

static void barrier_wait(barrier_t *b, int *local_sense, int n) {
    int s = !*local_sense;
    *local_sense = s;
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == n - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        atomic_store_explicit(&b->sense, s, memory_order_release);
        return;
    }
    for (int i = 0; atomic_load_explicit(&b->sense, memory_order_acquire) != s; i++) {
        if (i < IVY_SPIN) {
            cpu_relax();
        } else {
            sched_yield();
        }
    }
}

typedef void (*work_fn)(void *ctx, int tid, int nthreads, barrier_t *barrier);

/* ---- Threads from the process's OpenMP runtime, when one is loaded ------------------------------------------
 * torch's CPU ops run on its OpenMP team, whose workers keep spinning on their cores for a while after each
 * parallel region. Threads of our own would then compete with them for the same cores (on two cores the second
 * one gets about half of one). Running on that team instead reuses the spinning workers. The runtime is looked
 * up, never loaded: the entry points that compiled "#pragma omp parallel" code calls (GOMP_parallel, exported by
 * libgomp and, for compatibility, by LLVM's and Intel's runtimes) are taken from the process when present, so
 * the build needs no -fopenmp; without them the pthreads below run instead. */
typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);
typedef int (*omp_int_fn)(void);

static gomp_parallel_fn omp_parallel;
static omp_int_fn omp_thread_num, omp_num_threads;
static pthread_once_t omp_once = PTHREAD_ONCE_INIT;
static atomic_int omp_allowed = 1;

static void *omp_symbol(void *handle, const char *name) { return handle == NULL ? NULL : dlsym(handle, name); }

static void omp_resolve(void) {
    static const char *const names[] = {"libgomp.so.1", "libomp.so", "libiomp5.so", "libomp.dylib",
                                        "libiomp5.dylib"};
    void *handles[1 + sizeof(names) / sizeof(names[0])];
    int n = 0;
    handles[n++] = RTLD_DEFAULT;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        void *h = dlopen(names[i], RTLD_LAZY | RTLD_NOLOAD); /* only a runtime that is already loaded */
        if (h != NULL) handles[n++] = h;
    }
    for (int i = 0; i < n; i++) {
        void *par = omp_symbol(handles[i], "GOMP_parallel");
        void *num = omp_symbol(handles[i], "omp_get_thread_num");
        void *cnt = omp_symbol(handles[i], "omp_get_num_threads");
        if (par != NULL && num != NULL && cnt != NULL) {
            /* POSIX guarantees that a dlsym result converts to a function pointer. */
            *(void **)&omp_parallel = par;
            *(void **)&omp_thread_num = num;
            *(void **)&omp_num_threads = cnt;
            return;
        }
    }
}

/* 1 when the threads come from the process's OpenMP runtime, 0 when from pthreads. */
int ivy_openmp_threads(void) {
    pthread_once(&omp_once, omp_resolve);
    return omp_parallel != NULL && atomic_load_explicit(&omp_allowed, memory_order_relaxed);
}

/* Whether the OpenMP runtime may be used (1, the default) or pthreads always (0): for tests and comparisons. */
void ivy_allow_openmp(int allow) { atomic_store_explicit(&omp_allowed, allow != 0, memory_order_relaxed); }

typedef struct {
    work_fn fn;
    void *ctx;
    barrier_t *barrier;
    atomic_int used;
} omp_arg;

static void omp_trampoline(void *raw) {
    omp_arg *a = (omp_arg *)raw;
    int tid = omp_thread_num(), n = omp_num_threads();
    if (tid == 0) atomic_store_explicit(&a->used, n, memory_order_relaxed);
    a->fn(a->ctx, tid, n, a->barrier);
}

/* ---- Threads of our own ------------------------------------------------------------------------------------ */
typedef struct {
    work_fn fn;
    void *ctx;
    int tid;
    atomic_int *go;
    int *nthreads;
    barrier_t *barrier;
} thread_arg;

static void *trampoline(void *raw) {
    thread_arg *a = (thread_arg *)raw;
    for (int i = 0; !atomic_load_explicit(a->go, memory_order_acquire); i++) {
        if (i < IVY_SPIN) {
            cpu_relax();
        } else {
            sched_yield();
        }
    }
    a->fn(a->ctx, a->tid, *a->nthreads, a->barrier);
    return NULL;
}

/* Runs fn on `want` threads (the caller's is thread 0); fewer if threads cannot be had (a call from inside a
 * parallel region gets a team of one). Returns the count. */
static int run_threads(int want, work_fn fn, void *ctx) {
    barrier_t barrier;
    atomic_init(&barrier.count, 0);
    atomic_init(&barrier.sense, 0);
    if (want <= 1) {
        fn(ctx, 0, 1, &barrier);
        return 1;
    }
    if (want > IVY_MAX_THREADS) want = IVY_MAX_THREADS;
    if (ivy_openmp_threads()) {
        omp_arg arg;
        arg.fn = fn;
        arg.ctx = ctx;
        arg.barrier = &barrier;
        atomic_init(&arg.used, 1);
        omp_parallel(omp_trampoline, &arg, (unsigned)want, 0);
        return atomic_load_explicit(&arg.used, memory_order_relaxed);
    }
    pthread_t ids[IVY_MAX_THREADS];
    thread_arg args[IVY_MAX_THREADS];
    atomic_int go;
    atomic_init(&go, 0);
    int n = 1;
    for (int t = 1; t < want; t++) {
        args[t] = (thread_arg){fn, ctx, t, &go, &n, &barrier};
        if (pthread_create(&ids[t], NULL, trampoline, &args[t]) != 0) break;
        n++;
    }
    atomic_store_explicit(&go, 1, memory_order_release);
    fn(ctx, 0, n, &barrier);
    for (int t = 1; t < n; t++) pthread_join(ids[t], NULL);
    return n;
}

/* ------------------------------------------------------------------------------------------------------------ */
/* Sum of squares over a list of tensors: each thread takes one contiguous range of their concatenation.       */

typedef struct {
    int64_t count;
    const float *const *data;
    const int64_t *numels;
    int64_t total, block;
    atomic_llong next; /* next block to claim */
    double *block_sums;
} sumsq_job;

static double sumsq_range(const float *restrict x, int64_t lo, int64_t hi) {
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = lo; i < hi; i++) s += (double)x[i] * (double)x[i];
    return s;
}

/* Block b covers [b*block, (b+1)*block) of the tensors' concatenation. */
static double sumsq_block(const sumsq_job *job, int64_t b) {
    int64_t lo = b * job->block, hi = lo + job->block < job->total ? lo + job->block : job->total;
    double s = 0.0;
    int64_t base = 0;
    for (int64_t k = 0; k < job->count && base < hi; k++) {
        int64_t n = job->numels[k];
        int64_t a = lo > base ? lo - base : 0, e = hi < base + n ? hi - base : n;
        if (a < e) s += sumsq_range(job->data[k], a, e);
        base += n;
    }
    return s;
}

static void sumsq_work(void *raw, int tid, int nthreads, barrier_t *barrier) {
    (void)tid;
    (void)nthreads;
    (void)barrier;
    sumsq_job *job = (sumsq_job *)raw;
    int64_t blocks = (job->total + job->block - 1) / job->block;
    for (int64_t b; (b = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed)) < blocks;) {
        job->block_sums[b] = sumsq_block(job, b);
    }
}

/* Σ‖t‖² in double (NaN/Inf elements give a non-finite sum), or -1 when memory for the block sums cannot be had.
 * split_min: fewest elements worth a thread; parallel_min: fewest elements in all worth starting threads for;
 * block: elements per block a thread claims. */
double ivy_sumsq_f32(int64_t count, const float *const *data, const int64_t *numels, int threads,
                     int64_t split_min, int64_t parallel_min, int64_t block) {
    int64_t total = 0;
    for (int64_t k = 0; k < count; k++) total += numels[k];
    if (split_min < 1) split_min = 1;
    if (threads > IVY_MAX_THREADS) threads = IVY_MAX_THREADS;
    if (threads > 1 && total / split_min < threads) threads = (int)(total / split_min);
    if (total < parallel_min) threads = 1;
    if (threads < 1) threads = 1;
    if (block < 1) block = 1;
    int64_t blocks = (total + block - 1) / block;
    double *block_sums = (double *)malloc(sizeof(double) * (size_t)(blocks + 1));
    if (block_sums == NULL) return -1.0;
    sumsq_job job;
    job.count = count;
    job.data = data;
    job.numels = numels;
    job.total = total;
    job.block = block;
    atomic_init(&job.next, 0);
    job.block_sums = block_sums;
    run_threads(threads, sumsq_work, &job);
    double s = 0.0;
    for (int64_t b = 0; b < blocks; b++) s += block_sums[b];
    free(block_sums);
    return s;
}

/* ------------------------------------------------------------------------------------------------------------ */
/* The LAMB step.                                                                                              */

typedef struct {
    float beta1, one_minus_beta1, beta2, one_minus_beta2, grad_scale, weight_decay;
} hyper_t;

typedef struct {
    int64_t count;
    float *const *params;
    const float *const *grads;
    float *const *exp_avgs;
    float *const *exp_avg_sqs;
    const int64_t *numels;
    const float *c;     /* per tensor: sqrt(bc2)/bc1 */
    const float *eps_s; /* per tensor: eps*sqrt(bc2) */
    hyper_t h;
    double lr, min_ratio, max_ratio;
    int adapt;
    int64_t split_min, block;
    int max_threads; /* the threads asked for: the block lengths follow from it, whatever number could start */
    const int64_t *small; /* indices of the tensors run whole by one thread */
    int64_t n_small;
    atomic_llong next_small;
    const int64_t *large; /* indices of the tensors cut into blocks */
    int64_t n_large;
    atomic_llong *claims;    /* per large tensor: the next block to claim */
    int64_t *mine;           /* per thread, max_blocks slots: the blocks it claimed in the current tensor */
    int64_t max_blocks;
    const int64_t *sums_at;  /* per large tensor: where its blocks' sums start in block_sums */
    double *block_sums;      /* per block: |x|^2, |u|^2 */
    float *scratch;          /* scratch_len floats, one part per thread for u of its blocks, or NULL */
    int64_t scratch_len;
    double *ratios;
} lamb_job;

/* One element's moments, updated in place, and its direction u = c * m / (sqrt(v) + eps_s) + wd * x: the one
 * formula every pass below uses (inlined into each loop, so the loops still vectorise). */
static inline float lamb_moments(const hyper_t *h, float c, float eps_s, float xi, float gi_raw, float *restrict m,
                                 float *restrict v, int64_t i) {
    float gi = gi_raw * h->grad_scale;
    float mi = h->beta1 * m[i] + h->one_minus_beta1 * gi;
    float vi = h->beta2 * v[i] + h->one_minus_beta2 * (gi * gi);
    m[i] = mi;
    v[i] = vi;
    return c * (mi / (sqrtf(vi) + eps_s)) + h->weight_decay * xi;
}

/* Pass 1 over [lo, hi): moments in place, and the two squared norms into sums[0], sums[1]. With u_out (a
 * per-thread scratch small enough to stay in cache) it also keeps u: pass 2 then neither reads the moments again
 * nor repeats the square root and the division. */
static void lamb_pass1(const hyper_t *h, float c, float eps_s, const float *restrict x, const float *restrict g,
                       float *restrict m, float *restrict v, float *restrict u_out, int64_t lo, int64_t hi,
                       double *sums) {
    double sx = 0.0, su = 0.0;
    if (u_out != NULL) {
#pragma omp simd reduction(+ : sx, su)
        for (int64_t i = lo; i < hi; i++) {
            float xi = x[i];
            float u = lamb_moments(h, c, eps_s, xi, g[i], m, v, i);
            u_out[i - lo] = u;
            sx += (double)xi * (double)xi;
            su += (double)u * (double)u;
        }
    } else {
#pragma omp simd reduction(+ : sx, su)
        for (int64_t i = lo; i < hi; i++) {
            float xi = x[i];
            float u = lamb_moments(h, c, eps_s, xi, g[i], m, v, i);
            sx += (double)xi * (double)xi;
            su += (double)u * (double)u;
        }
    }
    sums[0] = sx;
    sums[1] = su;
}

/* Pass 2 from the kept u: x -= step * u. */
static void lamb_apply_kept(float step, float *restrict x, const float *restrict u, int64_t lo, int64_t hi) {
#pragma omp simd
    for (int64_t i = lo; i < hi; i++) x[i] = x[i] - step * u[i - lo];
}

/* Pass 2 over [lo, hi): x -= step * u, u recomputed from the updated moments. */
static void lamb_pass2(const hyper_t *h, float c, float eps_s, float step, float *restrict x, const float *restrict m,
                       const float *restrict v, int64_t lo, int64_t hi) {
    const float wd = h->weight_decay;
#pragma omp simd
    for (int64_t i = lo; i < hi; i++) {
        float xi = x[i];
        float u = c * (m[i] / (sqrtf(v[i]) + eps_s)) + wd * xi;
        x[i] = xi - step * u;
    }
}

/* Ratio 1 (layer adaptation excluded): moments and update in one pass. */
static void lamb_single_pass(const hyper_t *h, float c, float eps_s, float step, float *restrict x,
                             const float *restrict g, float *restrict m, float *restrict v, int64_t lo, int64_t hi) {
#pragma omp simd
    for (int64_t i = lo; i < hi; i++) {
        float xi = x[i];
        x[i] = xi - step * lamb_moments(h, c, eps_s, xi, g[i], m, v, i);
    }
}

static double trust_ratio(double x_sq, double u_sq, double lo, double hi) {
    double xn = sqrt(x_sq), un = sqrt(u_sq);
    if (xn > 0.0 && un > 0.0 && isfinite(xn) && isfinite(un)) {
        double r = xn / un;
        if (r < lo) r = lo;
        if (r > hi) r = hi;
        return r;
    }
    return 1.0;
}

static void first_pass(lamb_job *job, int64_t k, float *u, int64_t a, int64_t b, double *sums) {
    float c = job->c[k], e = job->eps_s[k];
    lamb_pass1(&job->h, c, e, job->params[k], job->grads[k], job->exp_avgs[k], job->exp_avg_sqs[k], u, a, b, sums);
}

static void second_pass(lamb_job *job, int64_t k, const float *u, float step, int64_t a, int64_t b) {
    float *x = job->params[k];
    int64_t end = b;
    while (end > a) { /* last block first: it is the one pass 1 left in cache */
        int64_t start = end - IVY_WALK > a ? end - IVY_WALK : a;
        if (u != NULL) {
            lamb_apply_kept(step, x + start, u + (start - a), 0, end - start);
        } else {
            lamb_pass2(&job->h, job->c[k], job->eps_s[k], step, x, job->exp_avgs[k], job->exp_avg_sqs[k], start, end);
        }
        end = start;
    }
}

/* Where in [u, u + IVY_SLACK) to keep a block's u: at least 256 bytes (mod 4096) from each of the block's other
 * streams, so that its stores never look like the next loads of x, g, m, v to the CPU ("4K aliasing", which
 * stalls the loads until the stores retire). A function of the pointers only: pass 2 finds the same place. */
static float *kept_at(float *u, const float *x, const float *g, const float *m, const float *v) {
    const float *streams[4] = {x, g, m, v};
    for (int64_t shift = 0; shift < IVY_SLACK; shift += 64) {
        uintptr_t at = (uintptr_t)(u + shift);
        int clear = 1;
        for (int j = 0; j < 4 && clear; j++) {
            uintptr_t d = (at - (uintptr_t)streams[j]) & 4095u;
            clear = d >= 256u && d <= 4096u - 256u;
        }
        if (clear) return u + shift;
    }
    return u;
}

/* The block length for a large tensor of n elements: about `block`, and a multiple of `threads` blocks of equal
 * length, so that the threads finish together when none is held up. */
static int64_t tensor_block(int64_t n, int threads, int64_t block) {
    int64_t per_round = (int64_t)threads * block;
    int64_t blocks = ((n + per_round - 1) / per_round) * threads;
    return (n + blocks - 1) / blocks;
}

/* One small tensor from start to end on this thread (u recomputed: the tensor is still in cache). */
static void lamb_whole(lamb_job *job, int64_t k) {
    int64_t n = job->numels[k];
    if (!job->adapt) {
        lamb_single_pass(&job->h, job->c[k], job->eps_s[k], (float)job->lr, job->params[k], job->grads[k],
                         job->exp_avgs[k], job->exp_avg_sqs[k], 0, n);
        job->ratios[k] = 1.0;
        return;
    }
    double sums[2];
    first_pass(job, k, NULL, 0, n, sums);
    double r = trust_ratio(sums[0], sums[1], job->min_ratio, job->max_ratio);
    job->ratios[k] = r;
    second_pass(job, k, NULL, (float)(job->lr * r), 0, n);
}

static void lamb_work(void *raw, int tid, int nthreads, barrier_t *barrier) {
    lamb_job *job = (lamb_job *)raw;
    int sense = 0;
    for (int64_t j; (j = atomic_fetch_add_explicit(&job->next_small, 1, memory_order_relaxed)) < job->n_small;) {
        lamb_whole(job, job->small[j]);
    }
    for (int64_t j = 0; j < job->n_large; j++) {
        int64_t k = job->large[j];
        int64_t n = job->numels[k], blk = tensor_block(n, job->max_threads, job->block);
        int64_t blocks = (n + blk - 1) / blk;
        atomic_llong *claim = job->claims + j;
        if (!job->adapt) {
            for (int64_t b; (b = atomic_fetch_add_explicit(&claim[0], 1, memory_order_relaxed)) < blocks;) {
                int64_t lo = b * blk, hi = lo + blk < n ? lo + blk : n;
                lamb_single_pass(&job->h, job->c[k], job->eps_s[k], (float)job->lr, job->params[k], job->grads[k],
                                 job->exp_avgs[k], job->exp_avg_sqs[k], lo, hi);
            }
            if (tid == 0) job->ratios[k] = 1.0;
            continue;
        }
        /* Each thread keeps u of its own blocks in its own part of the scratch, while there is room. */
        int64_t room = job->scratch == NULL ? 0 : job->scratch_len / nthreads / (blk + IVY_SLACK);
        float *own = job->scratch == NULL ? NULL : job->scratch + (job->scratch_len / nthreads) * tid;
        double *sums = job->block_sums + 2 * job->sums_at[j];
        int64_t *mine = job->mine + tid * job->max_blocks, taken = 0;
        for (int64_t b; (b = atomic_fetch_add_explicit(&claim[0], 1, memory_order_relaxed)) < blocks;) {
            int64_t lo = b * blk, hi = lo + blk < n ? lo + blk : n;
            float *u = taken < room ? kept_at(own + taken * (blk + IVY_SLACK), job->params[k] + lo,
                                              job->grads[k] + lo, job->exp_avgs[k] + lo, job->exp_avg_sqs[k] + lo)
                                    : NULL;
            first_pass(job, k, u, lo, hi, sums + 2 * b);
            mine[taken++] = b;
        }
        barrier_wait(barrier, &sense, nthreads); /* every block's sums are in; the barrier orders their writes before the reads */
        double x_sq = 0.0, u_sq = 0.0;
        for (int64_t b = 0; b < blocks; b++) {
            x_sq += sums[2 * b];
            u_sq += sums[2 * b + 1];
        }
        double r = trust_ratio(x_sq, u_sq, job->min_ratio, job->max_ratio);
        if (tid == 0) job->ratios[k] = r;
        /* Pass 2 over this thread's own blocks, last first: they are in its cache, not another core's. */
        while (taken > 0) {
            int64_t b = mine[--taken];
            int64_t lo = b * blk, hi = lo + blk < n ? lo + blk : n;
            float *u = taken < room ? kept_at(own + taken * (blk + IVY_SLACK), job->params[k] + lo,
                                              job->grads[k] + lo, job->exp_avgs[k] + lo, job->exp_avg_sqs[k] + lo)
                                    : NULL;
            second_pass(job, k, u, (float)(job->lr * r), lo, hi);
        }
    }
}

typedef struct {
    uintptr_t lo, hi;
} span_t;

static int span_cmp(const void *a, const void *b) {
    uintptr_t x = ((const span_t *)a)->lo, y = ((const span_t *)b)->lo;
    return x < y ? -1 : x > y;
}

/* Whether any two of the written or read buffers share memory (the threads would race on them). */
static int overlapping(int64_t count, float *const *params, const float *const *grads, float *const *exp_avgs,
                       float *const *exp_avg_sqs, const int64_t *numels, int *failed) {
    span_t *spans = (span_t *)malloc(sizeof(span_t) * (size_t)(4 * count + 1));
    if (spans == NULL) {
        *failed = 1;
        return 0;
    }
    int64_t n = 0;
    for (int64_t k = 0; k < count; k++) {
        if (numels[k] == 0) continue;
        uintptr_t bytes = (uintptr_t)numels[k] * sizeof(float);
        const void *ptrs[4] = {params[k], grads[k], exp_avgs[k], exp_avg_sqs[k]};
        for (int j = 0; j < 4; j++) {
            spans[n].lo = (uintptr_t)ptrs[j];
            spans[n].hi = (uintptr_t)ptrs[j] + bytes;
            n++;
        }
    }
    qsort(spans, (size_t)n, sizeof(span_t), span_cmp);
    int found = 0;
    for (int64_t i = 1; i < n && !found; i++) found = spans[i].lo < spans[i - 1].hi;
    free(spans);
    return found;
}

/*
 * One LAMB step over `count` tensors (hyperparameters shared, step counters per tensor, incremented here).
 * Threads as in ivy_sumsq_f32. scratch: scratch_len floats (or NULL), one part per thread, where u of the
 * thread's blocks waits between the passes while there is room.
 * ratios receives the trust ratio used per tensor. Returns the threads used (>= 1), or before changing anything:
 * -1 when memory for the bookkeeping cannot be had, -2 when two of the buffers overlap.
 */
int ivy_lamb_f32(int64_t count, float *const *params, const float *const *grads, float *const *exp_avgs,
                 float *const *exp_avg_sqs, float *const *steps, const int64_t *numels, double lr, double beta1,
                 double beta2, double eps, double weight_decay, int bias_correction, int adapt, double min_ratio,
                 double max_ratio, double grad_scale, int threads, int64_t split_min, int64_t parallel_min,
                 int64_t block, float *scratch, int64_t scratch_len, double *ratios) {
    int failed = 0;
    if (overlapping(count, params, grads, exp_avgs, exp_avg_sqs, numels, &failed)) return -2;
    if (failed) return -1;
    if (split_min < 1) split_min = 1;
    if (block < 1) block = 1;
    if (threads > IVY_MAX_THREADS) threads = IVY_MAX_THREADS;
    int64_t total = 0;
    for (int64_t k = 0; k < count; k++) total += numels[k];
    if (threads > 1 && total / split_min < threads) threads = (int)(total / split_min);
    if (total < parallel_min) threads = 1;
    if (threads < 1) threads = 1;

    size_t n = (size_t)count + 1;
    int64_t n_large = 0, large_blocks = 0, max_blocks = 0;
    for (int64_t k = 0; k < count; k++) {
        if (numels[k] >= split_min * threads) {
            int64_t blk = tensor_block(numels[k], threads, block), blocks = (numels[k] + blk - 1) / blk;
            n_large++;
            large_blocks += blocks;
            max_blocks = blocks > max_blocks ? blocks : max_blocks;
        }
    }
    int64_t *order = (int64_t *)malloc(sizeof(int64_t) * 2 * n); /* indices, then each large one's sums offset */
    float *coef = (float *)malloc(sizeof(float) * 2 * n);
    double *block_sums = (double *)malloc(sizeof(double) * (size_t)(2 * large_blocks + 1));
    atomic_llong *claims = (atomic_llong *)malloc(sizeof(atomic_llong) * (size_t)(n_large + 1));
    int64_t *mine = (int64_t *)malloc(sizeof(int64_t) * (size_t)(threads * max_blocks + 1));
    if (order == NULL || coef == NULL || block_sums == NULL || claims == NULL || mine == NULL) {
        free(order);
        free(coef);
        free(block_sums);
        free(claims);
        free(mine);
        return -1;
    }
    int64_t n_small = 0, j_large = count - n_large, offset = 0;
    int64_t *sums_at = order + n;
    for (int64_t k = 0; k < count; k++) {
        if (numels[k] >= split_min * threads) {
            sums_at[j_large - (count - n_large)] = offset;
            int64_t blk = tensor_block(numels[k], threads, block);
            offset += (numels[k] + blk - 1) / blk;
            order[j_large++] = k;
        } else {
            order[n_small++] = k;
        }
    }
    for (int64_t j = 0; j < n_large; j++) atomic_init(&claims[j], 0);
    for (int64_t k = 0; k < count; k++) {
        *steps[k] += 1.0f;
        double t = (double)*steps[k];
        double c = 1.0, e = eps;
        if (bias_correction) {
            double bc1 = 1.0 - pow(beta1, t), bc2_sqrt = sqrt(1.0 - pow(beta2, t));
            c = bc2_sqrt / bc1;
            e = eps * bc2_sqrt;
        }
        coef[k] = (float)c;
        coef[n + k] = (float)e;
    }
    lamb_job job;
    memset(&job, 0, sizeof(job));
    job.count = count;
    job.params = params;
    job.grads = grads;
    job.exp_avgs = exp_avgs;
    job.exp_avg_sqs = exp_avg_sqs;
    job.numels = numels;
    job.c = coef;
    job.eps_s = coef + n;
    job.h = (hyper_t){(float)beta1, (float)(1.0 - beta1), (float)beta2, (float)(1.0 - beta2), (float)grad_scale,
                      (float)weight_decay};
    job.lr = lr;
    job.min_ratio = min_ratio;
    job.max_ratio = max_ratio;
    job.adapt = adapt;
    job.split_min = split_min;
    job.block = block;
    job.max_threads = threads;
    job.small = order;
    job.n_small = n_small;
    atomic_init(&job.next_small, 0);
    job.large = order + n_small;
    job.n_large = n_large;
    job.claims = claims;
    job.mine = mine;
    job.max_blocks = max_blocks;
    job.sums_at = sums_at;
    job.block_sums = block_sums;
    job.scratch = scratch_len > 0 ? scratch : NULL;
    job.scratch_len = scratch_len;
    job.ratios = ratios;
    int used = run_threads(threads, lamb_work, &job);
    free(order);
    free(coef);
    free(block_sums);
    free(claims);
    free(mine);
    return used;
}
