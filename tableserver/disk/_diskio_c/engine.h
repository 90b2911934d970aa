/* tableserver/disk/_diskio_c/engine.h: what the files of tableserver.disk._diskio share -- the includes, the
 * constants, the status and mode codes, the core an engine's reads touch (struct core: the batch queue, the
 * ring, the threads) and the functions one file calls in another (prefixed diskio_). The Python interface
 * (Engine) is documented at the top of module.c.
 *
 *   module.c   the Python type Engine, the core's release (core_free) and the module's init
 *   queue.c    the batch queue under the core's mutex, what one read's result means for its run, the fault hook
 *   threads.c  the pthread engine ("threads": preadv), and the start and stop of either engine's threads
 *   uring.c    the io_uring engine: the ring, its one thread
 */
#ifndef TABLESERVER_DISKIO_ENGINE_H
#define TABLESERVER_DISKIO_ENGINE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

enum { ST_OK = 0, ST_ERROR = 1, ST_SHORT = 2, ST_TIMEOUT = 3, ST_BUSY = 4, ST_CUT = 5, ST_DROPPED = 6 };
enum { MODE_URING = 1, MODE_THREADS = 2 };

#define MAX_TRIES 16    /* EINTR/EAGAIN retries of one run */
#define ALIGN_CONT 512  /* a read cut short at a multiple of this is continued */
#define MAX_DEPTH 4096
#define MAX_QUEUED 2    /* batches queued: one being copied out of the pool while the next is read */
#define NO_CUT UINT64_MAX

struct run {
    int64_t fd, off, dst, len, need; /* from the caller */
    int64_t got;                     /* bytes read so far */
    int32_t tries;                   /* EINTR/EAGAIN retries so far */
    int32_t fault;                   /* the errno an injected fault completes it with */
};

struct batch {
    struct run *runs;
    size_t n, cap;
    size_t issued, finished, dropped; /* runs started, back (or failed), given up on a cut */
    uint64_t seq;                     /* batches are numbered from 1 */
    int64_t bytes, reads;
    int status;
    int64_t run, detail; /* the first failure */
};

struct ring {
    int fd;
    unsigned sq_entries, cq_entries, features;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    unsigned sq_local; /* the next SQE's index (published to *sq_tail by ring_enter) */
    struct io_uring_cqe *cqes;
    struct io_uring_sqe *sqes;
    void *sq_ptr, *cq_ptr;
    size_t sq_len, cq_len, sqes_len;
    int ext_arg;
};

struct pend {
    unsigned slot;
    size_t j;
};

struct event {
    unsigned slot;
    int st, again;
    size_t j;
    int64_t detail, bytes, reads;
};

/* Everything the engine's reads touch: leaked (never freed) when close() finds reads still in flight.
 * The queue, the counters and `cut` are under mu; a run's state belongs to the thread reading it. */
struct core {
    int mode, depth;
    int limit; /* reads the engine may have in flight now, 1..depth (Engine.limit; under mu) */
    int busy;  /* threads: runs being read */
    char *pool;
    size_t pool_len;
    /* the fault hook (tests) */
    int64_t fault_off;
    int fault_code;
    int efd;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    int mu_ok;
    struct batch q[MAX_QUEUED];
    unsigned head, count;
    uint64_t seq; /* the last batch's number */
    uint64_t cut; /* batches numbered >= cut start no new run (a failure, a timeout, drain); NO_CUT: none */
    int stop, idle, broken;
    pthread_t *tids;
    int nthreads;
    /* io_uring */
    struct ring ring;
    int fixed;
    struct pend *retry, *fill; /* the io_uring thread's: runs to issue again, runs to issue now */
    struct event *ev;          /* the io_uring thread's: completions to record */
};

/* -- time -------------------------------------------------------------------------------------------- */

static inline int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline int64_t deadline_after(double timeout_s)
{
    if (!(timeout_s > 0))
        timeout_s = 0;
    if (timeout_s > 1e9)
        timeout_s = 1e9; /* ~31 years: past it the int64 nanoseconds would overflow */
    return now_ns() + (int64_t)(timeout_s * 1e9);
}

static inline struct timespec to_timespec(int64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    return ts;
}

/* -- the cut (set under mu, read without it by the reading threads) --------------------------------- */

static inline int is_cut(struct core *c, const struct batch *b)
{
    return b->seq >= __atomic_load_n(&c->cut, __ATOMIC_ACQUIRE);
}

static inline void set_cut(struct core *c, uint64_t seq)
{
    if (seq < c->cut)
        __atomic_store_n(&c->cut, seq, __ATOMIC_RELEASE);
}

/* The functions below are the engine's own: hidden, so that the module exports PyInit__diskio alone and calls
 * between its files go straight to them (no PLT) */
#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

/* -- queue.c: the queue (under mu but for fault_for, wait_hold and settle) --------------------------- */

int diskio_fault_for(struct core *c, const struct run *u);
void diskio_wait_hold(struct core *c);
int diskio_settle(struct run *u, int64_t res, int *st, int64_t *detail);
int diskio_claim(struct core *c, unsigned *slot, size_t *j);
int64_t diskio_in_flight(const struct core *c);
void diskio_record(struct core *c, unsigned s, size_t j, int st, int64_t detail, int64_t bytes, int64_t reads);
int64_t diskio_drain(struct core *c, int64_t deadline);
void diskio_wait_head(struct core *c, int64_t deadline, int64_t out[5]);
int diskio_enqueue(struct core *c, const int64_t *const a[5], size_t n, int64_t deadline);

/* -- threads.c --------------------------------------------------------------------------------------- */

void *diskio_worker(void *arg);
int diskio_threads_start(struct core *c, int n, void *(*fn)(void *));
void diskio_threads_stop(struct core *c, int join);

/* -- uring.c ----------------------------------------------------------------------------------------- */

int diskio_ring_init(struct ring *R, unsigned entries);
int diskio_ring_register(struct ring *R, void *buf, size_t len);
void diskio_ring_free(struct ring *R);
void *diskio_driver(void *arg);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif /* TABLESERVER_DISKIO_ENGINE_H */
