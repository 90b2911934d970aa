/* tableserver.disk._diskio: the native read engine behind tableserver.disk.reader.DiskTable's page plan.
 *
 * Engine(mode, depth, pool)
 *   mode:  "io_uring" -- one ring of `depth` entries, driven by one engine thread; `pool` registered once
 *                        as a fixed buffer (IORING_OP_READ_FIXED; where registering fails, e.g. ENOMEM from
 *                        RLIMIT_MEMLOCK, plain IORING_OP_READ, `fixed` is False and `note` says why)
 *          "threads"  -- `depth` persistent pthreads doing preadv(2), each taking the next run in turn
 *   depth: reads kept in flight (1..4096), over a batch and across the batches queued
 *   pool:  a writable C-contiguous buffer (the page pool); held until close()
 *   io_uring_setup's failure (ENOSYS, EPERM, ENOMEM, ...) raises OSError with its errno.
 *
 * A batch is five equally long C-contiguous native int64 arrays, one entry a run: read lengths[i] bytes of
 * file fds[i] at file_offsets[i] into the pool at pool_offsets[i]; at least needs[i] of them must come back
 * (fewer is a short read: the file shrank). Runs are read in any order, `depth` at a time. A read cut
 * short at a 512-byte boundary is continued (EINTR/EAGAIN retried, a bounded number of times); a read
 * returning less at any other point, or 0, is final. Up to MAX_QUEUED batches are queued at once: the
 * engine goes on to the next batch's runs while the last reads of one are still in flight, so the
 * caller can copy rows out of one batch while the next is read (into another part of the pool).
 *
 * submit(fds, file_offsets, pool_offsets, lengths, needs, timeout_s) -> OK or BUSY
 *   Queues a batch (the arrays are copied). BUSY: reads of an abandoned batch (a timeout, drain) are
 *   still in flight after timeout_s: nothing is queued. RuntimeError when MAX_QUEUED batches are queued.
 * wait(timeout_s) -> (status, run, detail, bytes, reads): the oldest queued batch's result, once all its
 *   reads are back. OK: every run read (run = -1). ERROR: run `run` failed with errno `detail` (run -1:
 *   the ring itself failed). SHORT: run `run` got only `detail` bytes. CUT: the batch was cut short (a
 *   failure of an earlier one, drain). After a failure no new run of that batch or a later one starts.
 *   TIMEOUT: timeout_s passed with `detail` reads still in flight: every queued batch is abandoned (no
 *   new run starts) and stays queued until its reads are back. `bytes` and `reads` count what came back.
 * drain(timeout_s) -> reads still in flight: abandons every queued batch and waits up to timeout_s for
 *   their reads; 0: the queue is empty again.
 * read(...same as submit...) -> wait's tuple: submit and wait in one call (the queue must be empty);
 *   BUSY (detail: reads in flight) when an abandoned batch's reads are not back within timeout_s.
 *   The GIL is released while any of these wait.
 *
 * close(timeout_s=0) -> bool; idempotent. Waits up to timeout_s for a call running in another thread to
 *   return, then drains, waiting for the rest of timeout_s; True when the engine freed everything. False:
 *   reads are still in flight (or a call is still running in another thread), so the ring, the threads'
 *   state and the pool buffer are deliberately leaked (`leaked` is True): the kernel, or a stalled preadv,
 *   may still write into the pool, which must stay mapped. A close() while another thread's close() runs
 *   waits for it (up to its own timeout_s: False when that one is still running) and returns its outcome.
 *   From the moment close() starts, every call raises ValueError ("the engine is closed").
 *
 * limit: reads the engine may have in flight now, 1..depth (depth at first); settable from any thread while
 *   a call runs (it never waits on the call lock). Lowered, no read starts until fewer than it are in
 *   flight (those already at the drive finish); raised, more start at once. ValueError once closed.
 *
 * Getters: mode, depth, limit, fixed, ext_arg, note, inflight, queued, closed, leaked; safe from any thread
 *   at any time, during close() too. Once close() has started: mode "closed", depth and limit 0, fixed and
 *   ext_arg False, queued and inflight 0 -- but for a leaked engine, whose inflight and queued still count
 *   what its reads hold (its core is never freed).
 *
 * _fault(file_offset, code): for tests only. code > 0: a read covering byte file_offset (of any file)
 *   completes with that errno instead of being issued; code -1: such a read is held in flight (io_uring:
 *   a poll on an internal eventfd; threads: the worker waits on it) until _fault(..., 0) clears the fault.
 *
 * Why native: a Python thread pool costs the GIL and a thread switch per read; here one call queues a
 * whole batch, and Python runs only the page plan and the copy around it. io_uring: many SQEs per
 * io_uring_enter, which also waits for the next completion (no syscall per completion). Kernel features:
 * io_uring of Linux 5.10 (IORING_OP_READ, READ_FIXED, POLL_ADD, NOP, SINGLE_MMAP); IORING_ENTER_EXT_ARG
 * (5.11) and IORING_SETUP_COOP_TASKRUN (5.19) only where the kernel has them. Every wait is bounded: the
 * caller's by its timeout; the engine thread's on the ring by a tick (EXT_ARG's timeout, else poll(2) on
 * the ring fd), so that it sees new batches and cuts even while a read hangs. TABLESERVER_DISKIO_POLL_WAITS
 * set in the environment (tests) makes a ring wait as on a kernel before 5.11: poll(2), no COOP_TASKRUN.
 */
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

#ifndef TS_NO_IO_URING_H
#if defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#define HAVE_IO_URING_H 1
#endif
#endif
#endif

#ifndef HAVE_IO_URING_H
/* The few definitions used, as in Linux 5.10's include/uapi/linux/io_uring.h */
struct io_uring_sqe {
    uint8_t opcode;
    uint8_t flags;
    uint16_t ioprio;
    int32_t fd;
    uint64_t off;
    uint64_t addr;
    uint32_t len;
    union {
        uint32_t rw_flags;
        uint16_t poll_events;
        uint32_t poll32_events;
    };
    uint64_t user_data;
    uint16_t buf_index;
    uint16_t personality;
    int32_t splice_fd_in;
    uint64_t __pad2[2];
};
struct io_uring_cqe {
    uint64_t user_data;
    int32_t res;
    uint32_t flags;
};
struct io_sqring_offsets {
    uint32_t head, tail, ring_mask, ring_entries, flags, dropped, array, resv1;
    uint64_t resv2;
};
struct io_cqring_offsets {
    uint32_t head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1;
    uint64_t resv2;
};
struct io_uring_params {
    uint32_t sq_entries, cq_entries, flags, sq_thread_cpu, sq_thread_idle, features, wq_fd, resv[3];
    struct io_sqring_offsets sq_off;
    struct io_cqring_offsets cq_off;
};
#define IORING_OFF_SQ_RING 0ULL
#define IORING_OFF_CQ_RING 0x8000000ULL
#define IORING_OFF_SQES 0x10000000ULL
#define IORING_ENTER_GETEVENTS (1U << 0)
#define IORING_FEAT_SINGLE_MMAP (1U << 0)
#define IORING_REGISTER_BUFFERS 0
#define IORING_OP_NOP 0
#define IORING_OP_READ_FIXED 4
#define IORING_OP_POLL_ADD 6
#define IORING_OP_READ 22
#endif
_Static_assert(sizeof(struct io_uring_sqe) == 64, "io_uring_sqe is 64 bytes");
_Static_assert(sizeof(struct io_uring_cqe) == 16, "io_uring_cqe is 16 bytes");
_Static_assert(sizeof(struct io_uring_params) == 120, "io_uring_params is 120 bytes");

#ifndef IORING_ENTER_EXT_ARG
#define IORING_ENTER_EXT_ARG (1U << 3)
#endif
#ifndef IORING_FEAT_EXT_ARG
#define IORING_FEAT_EXT_ARG (1U << 8)
#endif
#ifndef IORING_SETUP_COOP_TASKRUN
#define IORING_SETUP_COOP_TASKRUN (1U << 8)
#endif
/* the syscall numbers are the same on every architecture but alpha (unified table since 5.1) */
#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#ifndef __NR_io_uring_register
#define __NR_io_uring_register 427
#endif

/* struct io_uring_getevents_arg and struct __kernel_timespec, spelled out (headers before 5.11 lack them) */
struct ext_arg {
    uint64_t sigmask;
    uint32_t sigmask_sz;
    uint32_t pad;
    uint64_t ts;
};
struct kts {
    int64_t tv_sec;
    long long tv_nsec;
};


enum { ST_OK = 0, ST_ERROR = 1, ST_SHORT = 2, ST_TIMEOUT = 3, ST_BUSY = 4, ST_CUT = 5, ST_DROPPED = 6 };
enum { MODE_URING = 1, MODE_THREADS = 2 };

#define MAX_TRIES 16    /* EINTR/EAGAIN retries of one run */
#define ALIGN_CONT 512  /* a read cut short at a multiple of this is continued */
#define MAX_DEPTH 4096
#define MAX_QUEUED 2    /* batches queued: one being copied out of the pool while the next is read */
#define THREAD_STACK (256 << 10)
#define TICK_NS 10000000 /* the io_uring thread looks for new batches and cuts at least this often */
/* The io_uring thread submits the reads it starts in slices of depth / SUBMIT_SLICES SQEs an io_uring_enter
 * (at least 1). A whole queue's worth in one call reaches a virtio disk as one burst, which it completes as
 * one burst (one notification for the lot): the queue then empties before the next burst goes out, and
 * the reads in flight average far below the depth. Slices keep the completions spread out, the queue full,
 * for a syscall every few reads (fio's io_uring engine makes one for every read). */
#define SUBMIT_SLICES 16
#define NO_CUT UINT64_MAX
/* an SQE's user_data: tag (2 bits) | queue slot (2 bits) | run index (60 bits) */
#define TAG_HOLD (1ULL << 62)
#define TAG_FAIL (2ULL << 62)
#define TAG_MASK (3ULL << 62)
#define SLOT_SHIFT 60
#define IDX_MASK ((1ULL << SLOT_SHIFT) - 1)

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

static unsigned long fork_gen; /* bumped in a forked child: an engine belongs to the process that made it */

static void after_fork_child(void) { fork_gen++; }

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t deadline_after(double timeout_s)
{
    if (!(timeout_s > 0))
        timeout_s = 0;
    if (timeout_s > 1e9)
        timeout_s = 1e9; /* ~31 years: past it the int64 nanoseconds would overflow */
    return now_ns() + (int64_t)(timeout_s * 1e9);
}

static struct timespec to_timespec(int64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    return ts;
}

/* -- the fault hook (tests) -------------------------------------------------------------------------- */

/* 0: no fault on this read; > 0: complete it with that errno; -1: hold it until the fault is cleared */
static int fault_for(struct core *c, const struct run *u)
{
    int code = __atomic_load_n(&c->fault_code, __ATOMIC_ACQUIRE);
    if (!code)
        return 0;
    int64_t at = __atomic_load_n(&c->fault_off, __ATOMIC_RELAXED);
    if (at < u->off + u->got || at >= u->off + u->len)
        return 0;
    return code > 0 ? code : -1;
}

static void wait_hold(struct core *c)
{
    struct pollfd p = {c->efd, POLLIN, 0};
    while (__atomic_load_n(&c->fault_code, __ATOMIC_ACQUIRE) < 0) {
        if (poll(&p, 1, -1) < 0 && errno != EINTR)
            break;
        if (p.revents)
            break;
    }
}

/* What one read's result means for its run: 0 done, 1 read (the rest) again, -1 failed (*st, *detail). */
static int settle(struct run *u, int64_t res, int *st, int64_t *detail)
{
    if (res < 0) {
        if ((res == -EINTR || res == -EAGAIN) && u->tries < MAX_TRIES) {
            u->tries++;
            return 1;
        }
        *st = ST_ERROR;
        *detail = -res;
        return -1;
    }
    u->got += res;
    if (u->got >= u->need)
        return 0;
    if (res > 0 && u->got < u->len && u->got % ALIGN_CONT == 0)
        return 1;
    *st = ST_SHORT;
    *detail = u->got;
    return -1;
}

/* -- the queue (under mu) ---------------------------------------------------------------------------- */

/* The next run to start, oldest batch first: 0 when none may start. */
static int claim(struct core *c, unsigned *slot, size_t *j)
{
    for (unsigned k = 0; k < c->count; k++) {
        unsigned s = (c->head + k) % MAX_QUEUED;
        struct batch *b = &c->q[s];
        if (b->seq >= c->cut)
            return 0; /* and every later one */
        if (b->issued < b->n) {
            *slot = s;
            *j = b->issued++;
            return 1;
        }
    }
    return 0;
}

static int batch_done(const struct core *c, const struct batch *b)
{
    return b->finished == b->issued && (b->issued == b->n || b->seq >= c->cut);
}

static int64_t in_flight(const struct core *c)
{
    int64_t n = 0;
    for (unsigned k = 0; k < c->count; k++) {
        const struct batch *b = &c->q[(c->head + k) % MAX_QUEUED];
        n += (int64_t)(b->issued - b->finished);
    }
    return n;
}

static int is_cut(struct core *c, const struct batch *b) { return b->seq >= __atomic_load_n(&c->cut, __ATOMIC_ACQUIRE); }

static void set_cut(struct core *c, uint64_t seq)
{
    if (seq < c->cut)
        __atomic_store_n(&c->cut, seq, __ATOMIC_RELEASE);
}

/* One run is back (or given up): its batch's counters, the first failure, the cut after it. */
static void record(struct core *c, unsigned s, size_t j, int st, int64_t detail, int64_t bytes, int64_t reads)
{
    struct batch *b = &c->q[s];
    b->finished++;
    b->bytes += bytes;
    b->reads += reads;
    if (st == ST_DROPPED) {
        b->dropped++;
    } else if (st != ST_OK) {
        if (b->status == ST_OK) {
            b->status = st;
            b->run = (int64_t)j;
            b->detail = detail;
        }
        set_cut(c, b->seq);
    }
    if (batch_done(c, b))
        pthread_cond_broadcast(&c->done);
}

/* Frees the done batches at the head of the queue; 1 when it is empty (and no cut is left). */
static int reclaim(struct core *c)
{
    while (c->count) {
        struct batch *b = &c->q[c->head];
        if (!batch_done(c, b))
            return 0;
        c->head = (c->head + 1) % MAX_QUEUED;
        c->count--;
    }
    c->head = 0;
    __atomic_store_n(&c->cut, NO_CUT, __ATOMIC_RELEASE);
    return 1;
}

static void wake_workers(struct core *c, size_t runs)
{
    if (c->mode == MODE_URING) {
        if (c->idle)
            pthread_cond_signal(&c->work);
        return;
    }
    size_t k = runs < (size_t)c->idle ? runs : (size_t)c->idle;
    if (k == (size_t)c->nthreads)
        pthread_cond_broadcast(&c->work);
    else
        for (size_t i = 0; i < k; i++)
            pthread_cond_signal(&c->work);
}

/* Waits on c->done until pred(c) or the deadline; the last pred(c). */
static int wait_until(struct core *c, int (*pred)(struct core *), int64_t deadline)
{
    struct timespec ts = to_timespec(deadline);
    while (!pred(c)) {
        if (pthread_cond_timedwait(&c->done, &c->mu, &ts) == ETIMEDOUT)
            return pred(c);
    }
    return 1;
}

static int head_done(struct core *c) { return batch_done(c, &c->q[c->head]); }

/* Abandons every queued batch and waits for their reads until the deadline: those still in flight. */
static int64_t drain(struct core *c, int64_t deadline)
{
    if (!c->count)
        return 0;
    set_cut(c, 0);
    pthread_cond_broadcast(&c->work);
    if (wait_until(c, reclaim, deadline))
        return 0;
    return in_flight(c);
}

static void batch_result(struct core *c, struct batch *b, int64_t out[5])
{
    int st = b->status;
    if (st == ST_OK && (b->issued < b->n || b->dropped))
        st = ST_CUT;
    out[0] = st;
    out[1] = st == ST_OK || st == ST_CUT ? -1 : b->run;
    out[2] = st == ST_OK || st == ST_CUT ? 0 : b->detail;
    out[3] = b->bytes;
    out[4] = b->reads;
}

/* The oldest batch's result once it is back; TIMEOUT (and everything queued abandoned) at the deadline. */
static void wait_head(struct core *c, int64_t deadline, int64_t out[5])
{
    if (!wait_until(c, head_done, deadline)) {
        set_cut(c, 0);
        pthread_cond_broadcast(&c->work);
        out[0] = c->broken ? ST_ERROR : ST_TIMEOUT;
        out[1] = -1;
        out[2] = c->broken ? c->broken : in_flight(c);
        out[3] = out[4] = 0;
        return;
    }
    struct batch *b = &c->q[c->head];
    batch_result(c, b, out);
    if (c->broken && out[0] == ST_OK) {
        out[0] = ST_ERROR;
        out[2] = c->broken;
    }
    c->head = (c->head + 1) % MAX_QUEUED;
    if (--c->count == 0)
        reclaim(c);
}

static int ensure_runs(struct batch *b, size_t n)
{
    if (n <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < n)
        cap *= 2;
    struct run *runs = realloc(b->runs, cap * sizeof *runs);
    if (runs == NULL)
        return -1;
    b->runs = runs;
    b->cap = cap;
    return 0;
}

/* Queues a batch: ST_OK, ST_BUSY (an abandoned batch's reads still in flight), or -1 (no memory). */
static int enqueue(struct core *c, const int64_t *const a[5], size_t n, int64_t deadline)
{
    if (c->count && c->cut == 0 && !wait_until(c, reclaim, deadline))
        return ST_BUSY;
    struct batch *b = &c->q[(c->head + c->count) % MAX_QUEUED];
    if (ensure_runs(b, n) < 0)
        return -1;
    for (size_t i = 0; i < n; i++) {
        struct run *u = &b->runs[i];
        u->fd = a[0][i], u->off = a[1][i], u->dst = a[2][i], u->len = a[3][i], u->need = a[4][i];
        u->got = 0, u->tries = 0, u->fault = 0;
    }
    b->n = n;
    b->issued = b->finished = b->dropped = 0;
    b->bytes = b->reads = 0;
    b->status = ST_OK;
    b->run = -1;
    b->detail = 0;
    b->seq = ++c->seq;
    c->count++;
    wake_workers(c, n);
    return ST_OK;
}

/* -- threads ----------------------------------------------------------------------------------------- */

static int thread_run(struct core *c, const struct batch *b, struct run *u, int64_t *detail, int64_t *bytes,
                      int64_t *reads)
{
    for (;;) {
        int64_t res;
        int code = fault_for(c, u);
        if (code < 0) {
            wait_hold(c);
            code = 0;
        }
        if (code > 0) {
            res = -code;
        } else {
            struct iovec iov = {c->pool + u->dst + u->got, (size_t)(u->len - u->got)};
            ssize_t k = preadv((int)u->fd, &iov, 1, (off_t)(u->off + u->got));
            res = k < 0 ? -(int64_t)errno : (int64_t)k;
            if (k >= 0) {
                *reads += 1;
                *bytes += k;
            }
        }
        int st;
        int s = settle(u, res, &st, detail);
        if (s == 0)
            return ST_OK;
        if (s < 0)
            return st;
        if (is_cut(c, b))
            return ST_DROPPED;
    }
}

static void *worker(void *arg)
{
    struct core *c = arg;
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        unsigned s;
        size_t j;
        if (c->busy >= c->limit || !claim(c, &s, &j)) {
            c->idle++;
            pthread_cond_wait(&c->work, &c->mu);
            c->idle--;
            continue;
        }
        struct batch *b = &c->q[s];
        struct run *u = &b->runs[j];
        c->busy++;
        pthread_mutex_unlock(&c->mu);
        int64_t detail = 0, bytes = 0, reads = 0;
        int st = thread_run(c, b, u, &detail, &bytes, &reads);
        pthread_mutex_lock(&c->mu);
        c->busy--;
        record(c, s, j, st, detail, bytes, reads);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* -- io_uring ---------------------------------------------------------------------------------------- */

static void ring_free(struct ring *R)
{
    if (R->sqes && R->sqes != MAP_FAILED)
        munmap(R->sqes, R->sqes_len);
    if (R->cq_ptr && R->cq_ptr != MAP_FAILED && R->cq_ptr != R->sq_ptr)
        munmap(R->cq_ptr, R->cq_len);
    if (R->sq_ptr && R->sq_ptr != MAP_FAILED)
        munmap(R->sq_ptr, R->sq_len);
    if (R->fd >= 0)
        close(R->fd);
    memset(R, 0, sizeof *R);
    R->fd = -1;
}

/* 0, or -errno (the ring freed) */
static int ring_init(struct ring *R, unsigned entries)
{
    struct io_uring_params p;
    int fd = -1;
    memset(R, 0, sizeof *R);
    R->fd = -1;
    /* COOP_TASKRUN (5.19+): completions are run when this task next enters the kernel (it always waits in
     * io_uring_enter or poll there), without an interrupt to another CPU first */
    unsigned const tries[2] = {IORING_SETUP_COOP_TASKRUN, 0};
    int legacy = getenv("TABLESERVER_DISKIO_POLL_WAITS") != NULL; /* tests: the waits of kernels before 5.11 */
    for (int i = legacy; i < 2 && fd < 0; i++) {
        memset(&p, 0, sizeof p);
        p.flags = tries[i];
        fd = (int)syscall(__NR_io_uring_setup, entries, &p);
        if (fd < 0 && errno != EINVAL)
            return -errno;
    }
    if (fd < 0)
        return -errno;
    R->fd = fd;
    R->sq_entries = p.sq_entries;
    R->cq_entries = p.cq_entries;
    R->features = p.features;
    R->ext_arg = (p.features & IORING_FEAT_EXT_ARG) != 0 && !legacy;
    R->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    R->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) {
        if (R->cq_len > R->sq_len)
            R->sq_len = R->cq_len;
        R->cq_len = R->sq_len;
    }
    R->sq_ptr = mmap(NULL, R->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    if (R->sq_ptr == MAP_FAILED)
        goto fail;
    if (single) {
        R->cq_ptr = R->sq_ptr;
    } else {
        R->cq_ptr = mmap(NULL, R->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
        if (R->cq_ptr == MAP_FAILED)
            goto fail;
    }
    R->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    R->sqes = mmap(NULL, R->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (R->sqes == MAP_FAILED)
        goto fail;
    char *sq = R->sq_ptr, *cq = R->cq_ptr;
    R->sq_head = (unsigned *)(sq + p.sq_off.head);
    R->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    R->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    R->sq_array = (unsigned *)(sq + p.sq_off.array);
    R->cq_head = (unsigned *)(cq + p.cq_off.head);
    R->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    R->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    R->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    for (unsigned i = 0; i < p.sq_entries; i++)
        R->sq_array[i] = i; /* SQE i always sits in slot i */
    R->sq_local = *R->sq_tail;
    return 0;
fail: {
    int e = errno;
    ring_free(R);
    return -e;
}
}

static struct io_uring_sqe *get_sqe(struct ring *R)
{
    unsigned head = __atomic_load_n(R->sq_head, __ATOMIC_ACQUIRE);
    if (R->sq_local - head >= R->sq_entries)
        return NULL;
    return &R->sqes[R->sq_local++ & *R->sq_mask];
}

static unsigned cq_ready(struct ring *R)
{
    return __atomic_load_n(R->cq_tail, __ATOMIC_ACQUIRE) - *R->cq_head;
}

/* Publishes the SQEs prepared, submits those the kernel has not taken yet and, when `wait`, waits for
 * one completion, at most wait_ns. 0 or -errno (EINTR, ETIME, EAGAIN, EBUSY: try again). */
static int ring_enter(struct ring *R, int wait, int64_t wait_ns)
{
    __atomic_store_n(R->sq_tail, R->sq_local, __ATOMIC_RELEASE);
    unsigned submit = R->sq_local - __atomic_load_n(R->sq_head, __ATOMIC_ACQUIRE);
    if (wait && cq_ready(R))
        wait = 0;
    if (!submit && !wait)
        return 0;
    long ret;
    if (wait && R->ext_arg) {
        if (wait_ns < 1000)
            wait_ns = 1000;
        struct kts ts = {wait_ns / 1000000000, wait_ns % 1000000000};
        struct ext_arg a = {0, 0, 0, (uint64_t)(uintptr_t)&ts};
        ret = syscall(__NR_io_uring_enter, R->fd, submit, 1, IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG, &a,
                      sizeof a);
        return ret < 0 ? -errno : 0;
    }
    if (submit) {
        ret = syscall(__NR_io_uring_enter, R->fd, submit, 0, 0, NULL, 0);
        if (ret < 0)
            return -errno;
    }
    if (wait && !cq_ready(R)) {
        struct pollfd p = {R->fd, POLLIN, 0};
        int ms = (int)((wait_ns + 999999) / 1000000);
        if (poll(&p, 1, ms > 0 ? ms : 1) < 0)
            return -errno;
    }
    return 0;
}

static int transient(int e) { return e == EINTR || e == ETIME || e == EAGAIN || e == EBUSY; }

static void prep(struct core *c, struct io_uring_sqe *s, unsigned slot, size_t j)
{
    struct run *u = &c->q[slot].runs[j];
    uint64_t id = ((uint64_t)slot << SLOT_SHIFT) | (uint64_t)j;
    memset(s, 0, sizeof *s);
    int code = fault_for(c, u);
    if (code < 0) {
        s->opcode = IORING_OP_POLL_ADD;
        s->fd = c->efd;
        s->poll_events = POLLIN;
        s->user_data = id | TAG_HOLD;
        return;
    }
    if (code > 0) {
        s->opcode = IORING_OP_NOP;
        u->fault = code;
        s->user_data = id | TAG_FAIL;
        return;
    }
    s->opcode = c->fixed ? IORING_OP_READ_FIXED : IORING_OP_READ;
    s->fd = (int)u->fd;
    s->off = (uint64_t)(u->off + u->got);
    s->addr = (uint64_t)(uintptr_t)(c->pool + u->dst + u->got);
    s->len = (uint32_t)(u->len - u->got);
    s->buf_index = 0;
    s->user_data = id;
}

/* Every completion there, settled into ev[] (recorded later, under mu); returns how many. */
static unsigned reap(struct core *c, struct event *ev)
{
    struct ring *R = &c->ring;
    unsigned head = *R->cq_head, tail = __atomic_load_n(R->cq_tail, __ATOMIC_ACQUIRE), k = 0;
    for (; head != tail; head++, k++) {
        const struct io_uring_cqe *cqe = &R->cqes[head & *R->cq_mask];
        uint64_t tag = cqe->user_data & TAG_MASK;
        struct event *v = &ev[k];
        v->slot = (unsigned)((cqe->user_data >> SLOT_SHIFT) & 3);
        v->j = (size_t)(cqe->user_data & IDX_MASK);
        v->st = ST_OK;
        v->again = 0;
        v->detail = v->bytes = v->reads = 0;
        struct run *u = &c->q[v->slot].runs[v->j];
        if (tag == TAG_HOLD) { /* the fault was cleared: now the read itself */
            v->again = 1;
            continue;
        }
        int64_t res = tag == TAG_FAIL ? -u->fault : cqe->res;
        if (tag != TAG_FAIL && res >= 0) {
            v->reads = 1;
            v->bytes = res;
        }
        int s = settle(u, res, &v->st, &v->detail);
        if (s > 0)
            v->again = 1;
        else if (s == 0)
            v->st = ST_OK;
    }
    __atomic_store_n(R->cq_head, head, __ATOMIC_RELEASE);
    return k;
}

/* The io_uring engine's thread: keeps `depth` reads in flight over the queued batches, oldest first. */
static void *driver(void *arg)
{
    struct core *c = arg;
    struct ring *R = &c->ring;
    unsigned inflight = 0, depth = (unsigned)c->depth;
    size_t nretry = 0, slice = depth / SUBMIT_SLICES ? depth / SUBMIT_SLICES : 1;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        size_t keep = 0, nfill = 0;
        for (size_t i = 0; i < nretry; i++) { /* a cut batch's retries are given up */
            struct pend p = c->retry[i];
            if (c->q[p.slot].seq >= c->cut)
                record(c, p.slot, p.j, ST_DROPPED, 0, 0, 0);
            else
                c->retry[keep++] = p;
        }
        nretry = keep;
        unsigned lim = (unsigned)c->limit < depth ? (unsigned)c->limit : depth; /* lowered: the reads drain to it */
        while (inflight + nfill < lim && nretry)
            c->fill[nfill++] = c->retry[--nretry];
        unsigned s;
        size_t j;
        while (inflight + nfill < lim && claim(c, &s, &j)) {
            c->fill[nfill].slot = s;
            c->fill[nfill++].j = j;
        }
        if (inflight + nfill == 0) {
            if (c->stop)
                break;
            c->idle = 1;
            pthread_cond_wait(&c->work, &c->mu);
            c->idle = 0;
            continue;
        }
        pthread_mutex_unlock(&c->mu);
        int sliced = 1;
        for (size_t i = 0; i < nfill; i++) {
            struct io_uring_sqe *sqe = get_sqe(R);
            if (sqe == NULL) { /* cannot happen: at most depth <= sq_entries SQEs are out */
                c->retry[nretry++] = c->fill[i];
                continue;
            }
            prep(c, sqe, c->fill[i].slot, c->fill[i].j);
            inflight++;
            if (sliced && (i + 1) % slice == 0 && i + 1 < nfill) {
                int e = ring_enter(R, 0, 0);
                sliced = e == 0 || transient(-e); /* else the rest go with the call below (which says why) */
            }
        }
        int e = ring_enter(R, 1, TICK_NS);
        unsigned nev = reap(c, c->ev);
        inflight -= nev;
        if (e < 0 && !transient(-e)) {
            struct timespec nap = {0, TICK_NS};
            nanosleep(&nap, NULL); /* a broken ring: no spinning on it */
        } else if ((e == -EAGAIN || e == -EBUSY) && nev == 0) {
            struct timespec nap = {0, 50000}; /* the kernel short of resources for a moment */
            nanosleep(&nap, NULL);
        }
        pthread_mutex_lock(&c->mu);
        if (e < 0 && !transient(-e) && !c->broken) {
            c->broken = -e;
            set_cut(c, 0);
            pthread_cond_broadcast(&c->done);
        }
        for (unsigned i = 0; i < nev; i++) {
            struct event *v = &c->ev[i];
            if (!v->again)
                record(c, v->slot, v->j, v->st, v->detail, v->bytes, v->reads);
            else if (c->q[v->slot].seq >= c->cut)
                record(c, v->slot, v->j, ST_DROPPED, 0, v->bytes, v->reads);
            else {
                c->q[v->slot].bytes += v->bytes; /* a continued read: what came back so far */
                c->q[v->slot].reads += v->reads;
                c->retry[nretry].slot = v->slot;
                c->retry[nretry++].j = v->j;
            }
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* -- the threads --------------------------------------------------------------------------------------- */

/* Stops the threads: joined when nothing is in flight, else detached (and the core leaked: a stalled read
 * may still write into the pool, and its thread touches the core when it returns). */
static void threads_stop(struct core *c, int join)
{
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    pthread_cond_broadcast(&c->work);
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < c->nthreads; i++) {
        if (join)
            pthread_join(c->tids[i], NULL);
        else
            pthread_detach(c->tids[i]);
    }
    c->nthreads = 0;
}

static int threads_start(struct core *c, int n, void *(*fn)(void *))
{
    pthread_attr_t attr;
    sigset_t all, old;
    int e = 0;
    c->tids = calloc((size_t)n, sizeof(pthread_t));
    if (c->tids == NULL)
        return ENOMEM;
    pthread_attr_init(&attr);
    size_t stack = THREAD_STACK;
#ifdef PTHREAD_STACK_MIN
    if (stack < (size_t)PTHREAD_STACK_MIN)
        stack = (size_t)PTHREAD_STACK_MIN;
#endif
    pthread_attr_setstacksize(&attr, stack);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* signals stay with Python's threads */
    for (int i = 0; i < n; i++) {
        e = pthread_create(&c->tids[i], &attr, fn, c);
        if (e)
            break;
        c->nthreads++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (e)
        threads_stop(c, 1);
    return e;
}

/* -- the core ---------------------------------------------------------------------------------------- */

static void core_free(struct core *c)
{
    if (c->nthreads)
        threads_stop(c, 1);
    if (c->mode == MODE_URING)
        ring_free(&c->ring);
    if (c->mu_ok) {
        pthread_cond_destroy(&c->work);
        pthread_cond_destroy(&c->done);
        pthread_mutex_destroy(&c->mu);
    }
    if (c->efd >= 0)
        close(c->efd);
    for (int i = 0; i < MAX_QUEUED; i++)
        free(c->q[i].runs);
    free(c->tids);
    free(c->retry);
    free(c->fill);
    free(c->ev);
    free(c);
}

/* -- the Python type --------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    struct core *c;
    Py_buffer pool;
    int have_pool;
    /* One call into the engine at a time. A call takes it (enter_call) and checks `closed` with the GIL held;
     * close() sets `closed` with the GIL held, then waits for it before it drains and frees the core. */
    pthread_mutex_t call;
    /* Held by the close() that runs (taken with the GIL, before that close releases it; let go of with the
     * GIL, once `leaked` and `c` say how it ended): a second close() waits on it for the outcome. */
    pthread_mutex_t closing_mu;
    int call_ok, closing_ok, closed, closing, leaked;
    unsigned long fork_gen;
    PyObject *note;
} Engine;

static int is_int64(const Py_buffer *b)
{
    const char *f = b->format;
    if (b->itemsize != 8 || f == NULL)
        return 0;
    if (*f == '@' || *f == '=' || (PY_LITTLE_ENDIAN ? *f == '<' : *f == '>'))
        f++;
    return (f[0] == 'l' || f[0] == 'q') && f[1] == '\0';
}

static const char *errname(int e)
{
    switch (e) {
    case ENOMEM: return "ENOMEM";
    case EPERM: return "EPERM";
    case EFAULT: return "EFAULT";
    case EINVAL: return "EINVAL";
    case EOPNOTSUPP: return "EOPNOTSUPP";
    case ENOSYS: return "ENOSYS";
    case EACCES: return "EACCES";
    default: return "errno";
    }
}

static int Engine_init(Engine *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"mode", "depth", "pool", NULL};
    const char *mode;
    int depth, e;
    PyObject *pool;
    if (self->c != NULL || self->have_pool || self->closed) {
        PyErr_SetString(PyExc_RuntimeError, "Engine is initialised once");
        return -1;
    }
    /* closed until it is all up: parsing the arguments may run Python code (and another thread, which
     * must not initialise it a second time, nor call it) */
    self->closed = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "siO", kwlist, &mode, &depth, &pool))
        return -1;
    int m = strcmp(mode, "io_uring") == 0 ? MODE_URING : strcmp(mode, "threads") == 0 ? MODE_THREADS : 0;
    if (!m) {
        PyErr_Format(PyExc_ValueError, "mode %s: pass \"io_uring\" or \"threads\"", mode);
        return -1;
    }
    if (depth < 1 || depth > MAX_DEPTH) {
        PyErr_Format(PyExc_ValueError, "depth=%d: pass 1..%d", depth, MAX_DEPTH);
        return -1;
    }
    if (PyObject_GetBuffer(pool, &self->pool, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->have_pool = 1;
    if (self->pool.len <= 0) {
        PyErr_SetString(PyExc_ValueError, "pool must be a non-empty writable buffer");
        goto fail;
    }
    if ((e = pthread_mutex_init(&self->call, NULL)) != 0) {
        errno = e;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, "pthread_mutex_init");
        goto fail;
    }
    self->call_ok = 1;
    if ((e = pthread_mutex_init(&self->closing_mu, NULL)) != 0) {
        errno = e;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, "pthread_mutex_init");
        goto fail;
    }
    self->closing_ok = 1;
    struct core *c = calloc(1, sizeof *c);
    if (c == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    self->c = c;
    c->mode = m;
    c->depth = c->limit = depth;
    c->pool = self->pool.buf;
    c->pool_len = (size_t)self->pool.len;
    c->efd = -1;
    c->ring.fd = -1;
    c->cut = NO_CUT;
    self->fork_gen = fork_gen;
    pthread_condattr_t ca;
    if (pthread_mutex_init(&c->mu, NULL) != 0 || pthread_condattr_init(&ca) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_mutex_init failed");
        goto fail;
    }
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->work, NULL);
    pthread_cond_init(&c->done, &ca);
    pthread_condattr_destroy(&ca);
    c->mu_ok = 1;
    if (m == MODE_URING) {
        c->retry = malloc((size_t)depth * sizeof *c->retry);
        c->fill = malloc((size_t)depth * sizeof *c->fill);
        c->ev = malloc((size_t)depth * 2 * sizeof *c->ev);
        if (c->retry == NULL || c->fill == NULL || c->ev == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        Py_BEGIN_ALLOW_THREADS
        e = ring_init(&c->ring, (unsigned)depth);
        Py_END_ALLOW_THREADS
        if (e < 0) {
            errno = -e;
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, "io_uring_setup");
            goto fail;
        }
        struct iovec iov = {c->pool, c->pool_len};
        long ret;
        Py_BEGIN_ALLOW_THREADS
        ret = syscall(__NR_io_uring_register, c->ring.fd, IORING_REGISTER_BUFFERS, &iov, 1);
        Py_END_ALLOW_THREADS
        if (ret == 0) {
            c->fixed = 1;
            self->note = PyUnicode_FromString("page pool registered (READ_FIXED)");
        } else {
            int err = errno;
            self->note = PyUnicode_FromFormat("page pool not registered (%s: %s%s): plain READ", errname(err),
                                              strerror(err),
                                              err == ENOMEM ? "; RLIMIT_MEMLOCK (ulimit -l) below the pool's size" : "");
        }
    } else {
        self->note = PyUnicode_FromFormat("%d threads over preadv", depth);
    }
    if (self->note == NULL)
        goto fail;
    Py_BEGIN_ALLOW_THREADS
    e = threads_start(c, m == MODE_URING ? 1 : depth, m == MODE_URING ? driver : worker);
    Py_END_ALLOW_THREADS
    if (e) {
        errno = e;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, "pthread_create");
        goto fail;
    }
    self->closed = 0;
    return 0;
fail:
    if (self->c) {
        core_free(self->c);
        self->c = NULL;
    }
    if (self->have_pool) {
        PyBuffer_Release(&self->pool);
        self->have_pool = 0;
    }
    Py_CLEAR(self->note);
    return -1;
}

static int usable(Engine *self)
{
    if (self->c == NULL || self->closed) {
        PyErr_SetString(PyExc_ValueError, "the engine is closed");
        return 0;
    }
    if (self->fork_gen != fork_gen) {
        PyErr_SetString(PyExc_RuntimeError, "the engine was made in the parent process: open a new reader after fork");
        return 0;
    }
    return 1;
}

/* The way into the engine of every call that releases the GIL (submit, read, wait, drain): the call lock,
 * then `closed` checked again under it, all with the GIL held. close() sets `closed` with the GIL held and
 * only then waits for the call lock, so a call that holds the lock and saw `closed` clear has the core
 * until it lets go of the lock; one that sees `closed` set (a close waiting for the lock, or one that has
 * freed the core and waits for the GIL to clear self->c) touches nothing. 1: entered (unlock self->call
 * when done); 0: refused, with the exception set. Anything that may run Python code (argument
 * conversions, buffer exports) must come before it: the GIL may change hands there. */
static int enter_call(Engine *self)
{
    if (!usable(self))
        return 0;
    if (pthread_mutex_trylock(&self->call) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "the engine is in use by another thread: one call at a time");
        return 0;
    }
    if (!usable(self)) {
        pthread_mutex_unlock(&self->call);
        return 0;
    }
    return 1;
}

static double get_timeout(PyObject *arg)
{
    double t = PyFloat_AsDouble(arg);
    if (t == -1.0 && PyErr_Occurred())
        return -1;
    if (!(t >= 0)) {
        PyErr_SetString(PyExc_ValueError, "timeout_s must be >= 0");
        return -1;
    }
    return t;
}

static PyObject *result_tuple(const int64_t r[5])
{
    return Py_BuildValue("(iLLLL)", (int)r[0], (long long)r[1], (long long)r[2], (long long)r[3], (long long)r[4]);
}

/* submit's and read's work: the batch checked, then queued (and, for read, waited for) */
static PyObject *queue_batch(Engine *self, PyObject *const *args, Py_ssize_t nargs, int and_wait)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "takes (fds, file_offsets, pool_offsets, lengths, needs, timeout_s)");
        return NULL;
    }
    double timeout = get_timeout(args[5]);
    if (timeout < 0 || !usable(self))
        return NULL;
    Py_buffer b[5];
    int got = 0;
    for (; got < 5; got++)
        if (PyObject_GetBuffer(args[got], &b[got], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            break;
    PyObject *ret = NULL;
    if (got < 5)
        goto done;
    for (int i = 0; i < 5; i++) {
        if (!is_int64(&b[i]) || ((uintptr_t)b[i].buf & 7)) {
            PyErr_SetString(PyExc_TypeError, "a batch is aligned native int64 arrays");
            goto done;
        }
        if (b[i].len != b[0].len) {
            PyErr_SetString(PyExc_ValueError, "a batch's five arrays must be equally long");
            goto done;
        }
    }
    size_t n = (size_t)b[0].len / 8;
    const int64_t *const a[5] = {b[0].buf, b[1].buf, b[2].buf, b[3].buf, b[4].buf};
    /* the buffer exports above may have run Python code, and another thread close(): self->c only from here */
    if (!enter_call(self))
        goto done;
    struct core *c = self->c;
    int64_t pool_len = (int64_t)c->pool_len;
    for (size_t i = 0; i < n; i++) {
        int64_t fd = a[0][i], off = a[1][i], dst = a[2][i], len = a[3][i], need = a[4][i];
        if (fd < 0 || fd > INT32_MAX || off < 0 || len <= 0 || len > INT32_MAX || dst < 0 || dst > pool_len - len ||
            need < 0 || need > len || off > INT64_MAX - len) {
            PyErr_Format(PyExc_ValueError,
                         "run %zu: fd %lld, file offset %lld, pool offset %lld, length %lld, need %lld do not fit "
                         "(pool of %lld bytes)",
                         i, (long long)fd, (long long)off, (long long)dst, (long long)len, (long long)need,
                         (long long)pool_len);
            pthread_mutex_unlock(&self->call);
            goto done;
        }
    }
    int64_t r[5] = {ST_OK, -1, 0, 0, 0};
    int st, full;
    Py_BEGIN_ALLOW_THREADS
    int64_t deadline = deadline_after(timeout);
    pthread_mutex_lock(&c->mu);
    full = c->count && c->cut != 0 && (and_wait || c->count == MAX_QUEUED); /* abandoned batches: enqueue waits */
    st = full ? ST_OK : enqueue(c, a, n, deadline);
    if (st == ST_BUSY) {
        r[0] = ST_BUSY;
        r[2] = in_flight(c);
    } else if (st == ST_OK && !full && and_wait) {
        wait_head(c, deadline, r);
    }
    pthread_mutex_unlock(&c->mu);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&self->call);
    if (full)
        PyErr_SetString(PyExc_RuntimeError, and_wait ? "read() needs an empty queue: wait() or drain() first"
                                                     : "the queue is full: wait() for a batch first");
    else if (st < 0)
        PyErr_NoMemory();
    else
        ret = and_wait ? result_tuple(r) : PyLong_FromLong(r[0]);
done:
    while (got--)
        PyBuffer_Release(&b[got]);
    return ret;
}

static PyObject *Engine_submit(Engine *self, PyObject *const *args, Py_ssize_t nargs)
{
    return queue_batch(self, args, nargs, 0);
}

static PyObject *Engine_read(Engine *self, PyObject *const *args, Py_ssize_t nargs)
{
    return queue_batch(self, args, nargs, 1);
}

static PyObject *Engine_wait(Engine *self, PyObject *arg)
{
    double timeout = get_timeout(arg);
    if (timeout < 0 || !enter_call(self))
        return NULL;
    struct core *c = self->c;
    int64_t r[5] = {ST_OK, -1, 0, 0, 0};
    int empty;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&c->mu);
    empty = c->count == 0;
    if (!empty)
        wait_head(c, deadline_after(timeout), r);
    pthread_mutex_unlock(&c->mu);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&self->call);
    if (empty) {
        PyErr_SetString(PyExc_RuntimeError, "wait(): no batch queued");
        return NULL;
    }
    return result_tuple(r);
}

static PyObject *Engine_drain(Engine *self, PyObject *arg)
{
    double timeout = get_timeout(arg);
    if (timeout < 0 || !enter_call(self))
        return NULL;
    struct core *c = self->c;
    int64_t left;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&c->mu);
    left = drain(c, deadline_after(timeout));
    pthread_mutex_unlock(&c->mu);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&self->call);
    return PyLong_FromLongLong((long long)left);
}

/* Another thread's close() is running (its GIL released): waits for it up to timeout. 1 when it ended. */
static int wait_other_close(Engine *self, double timeout)
{
    if (!self->closing)
        return 1;
    if (!self->closing_ok || self->fork_gen != fork_gen) /* a forked child: that close ran in the parent */
        return 0;
    int ended;
    Py_BEGIN_ALLOW_THREADS
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    int64_t wait_ns = deadline_after(timeout) - now_ns();
    struct timespec until = to_timespec((int64_t)rt.tv_sec * 1000000000 + rt.tv_nsec + wait_ns);
    ended = pthread_mutex_timedlock(&self->closing_mu, &until) == 0;
    if (ended)
        pthread_mutex_unlock(&self->closing_mu);
    Py_END_ALLOW_THREADS
    return ended && !self->closing;
}

/* Frees the engine when nothing is in flight, else leaks what reads may still touch. Returns 1 when freed.
 * Called with the GIL. `closed` is set before the GIL is first released: from then on every getter and
 * every call refuses to touch the core (enter_call, live()); the core is freed only with the call lock
 * held, so after every call that entered before has let go of it. */
static int engine_close(Engine *self, double timeout)
{
    if (self->closed) {
        if (!wait_other_close(self, timeout))
            return 0; /* still closing: not (yet) known to be freed */
        return !self->leaked;
    }
    self->closed = 1;
    struct core *c = self->c;
    if (c == NULL)
        return 1;
    if (self->fork_gen != fork_gen) { /* a forked child: no threads here, the parent's reads are not ours */
        if (c->mode == MODE_URING && c->ring.fd >= 0)
            close(c->ring.fd);
        self->c = NULL;
        if (self->have_pool) {
            PyBuffer_Release(&self->pool);
            self->have_pool = 0;
        }
        return 1;
    }
    /* Uncontended: only the one close() that found `closed` clear takes it, with the GIL, before releasing it */
    int held = pthread_mutex_trylock(&self->closing_mu) == 0;
    self->closing = held;
    int64_t left = 1;
    Py_BEGIN_ALLOW_THREADS
    int64_t deadline = deadline_after(timeout);
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    struct timespec until = to_timespec((int64_t)rt.tv_sec * 1000000000 + rt.tv_nsec + (deadline - now_ns()));
    int locked = pthread_mutex_timedlock(&self->call, &until) == 0;
    if (locked) {
        pthread_mutex_lock(&c->mu);
        left = drain(c, deadline);
        pthread_mutex_unlock(&c->mu);
    }
    if (!left)
        core_free(c); /* joins the threads: they are idle */
    else
        threads_stop(c, 0); /* idle threads exit, a stalled one once its read is back; the core stays */
    if (locked)
        pthread_mutex_unlock(&self->call);
    Py_END_ALLOW_THREADS
    if (left) {
        self->leaked = 1; /* the core (kept in self->c, never freed) and the pool buffer outlive the reads */
    } else {
        self->c = NULL;
        if (self->have_pool) {
            PyBuffer_Release(&self->pool);
            self->have_pool = 0;
        }
    }
    self->closing = 0;
    if (held)
        pthread_mutex_unlock(&self->closing_mu); /* with the GIL: a waiting close() then reads `leaked` */
    return !left;
}

static PyObject *Engine_close(Engine *self, PyObject *const *args, Py_ssize_t nargs)
{
    double timeout = 0;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "close(timeout_s=0) takes at most 1 argument");
        return NULL;
    }
    if (nargs == 1 && (timeout = get_timeout(args[0])) < 0)
        return NULL;
    return PyBool_FromLong(engine_close(self, timeout));
}

static PyObject *Engine_fault(Engine *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "_fault(file_offset, code) takes 2 arguments");
        return NULL;
    }
    long long at = PyLong_AsLongLong(args[0]);
    long code = PyLong_AsLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (code < -1 || code > 4095) {
        PyErr_SetString(PyExc_ValueError, "code: an errno, -1 (hold) or 0 (clear)");
        return NULL;
    }
    /* From here on the GIL is held throughout (no Python code, no release): close() cannot start before this
     * returns, and a leaked core (`leaked` set) is never freed. A leaked engine's fault may still be cleared. */
    if (self->c == NULL || (!self->leaked && !usable(self))) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "the engine is closed");
        return NULL;
    }
    struct core *c = self->c;
    if (c->efd < 0) {
        c->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (c->efd < 0)
            return PyErr_SetFromErrno(PyExc_OSError);
    }
    uint64_t v;
    if (code == -1 && read(c->efd, &v, sizeof v) < 0 && errno != EAGAIN) /* not readable until cleared */
        return PyErr_SetFromErrno(PyExc_OSError);
    __atomic_store_n(&c->fault_off, (int64_t)at, __ATOMIC_RELAXED);
    int old = __atomic_exchange_n(&c->fault_code, (int)code, __ATOMIC_ACQ_REL);
    if (old == -1 && code != -1) {
        v = 1;
        if (write(c->efd, &v, sizeof v) < 0)
            return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static void Engine_dealloc(Engine *self)
{
    int freed = engine_close(self, 0); /* no other thread can be in a call, nor in close(): they hold a reference */
    if (freed && self->call_ok)
        pthread_mutex_destroy(&self->call);
    if (self->closing_ok && !self->closing)
        pthread_mutex_destroy(&self->closing_mu);
    Py_CLEAR(self->note);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The getters run with the GIL and never release it. They touch the core only through live() or kept():
 * close() sets `closed` with the GIL before it frees anything, and sets `leaked` (with the GIL) only once
 * it has let go of the core for good. `closed`, `leaked` and `note` live in the object itself. */

/* The core, while no close() has started (else NULL) */
static struct core *live(Engine *self) { return self->closed ? NULL : self->c; }

/* The core whose queue may be read under its mu: a live one, or a leaked one (never freed); NULL in a
 * forked child (mu may be held there forever by a thread that does not exist) */
static struct core *kept(Engine *self)
{
    struct core *c = self->closed && !self->leaked ? NULL : self->c;
    return c != NULL && c->mu_ok && self->fork_gen == fork_gen ? c : NULL;
}

static PyObject *get_mode(Engine *self, void *_)
{
    struct core *c = live(self);
    if (c == NULL)
        return PyUnicode_FromString("closed");
    return PyUnicode_FromString(c->mode == MODE_THREADS ? "threads" : "io_uring");
}

static PyObject *get_fixed(Engine *self, void *_)
{
    struct core *c = live(self);
    return PyBool_FromLong(c && c->fixed);
}

static PyObject *get_depth(Engine *self, void *_)
{
    struct core *c = live(self);
    return PyLong_FromLong(c ? c->depth : 0);
}

static PyObject *get_ext_arg(Engine *self, void *_)
{
    struct core *c = live(self);
    return PyBool_FromLong(c && c->ring.ext_arg);
}

static PyObject *get_limit(Engine *self, void *_)
{
    struct core *c = self->fork_gen == fork_gen ? live(self) : NULL;
    long n = 0;
    if (c != NULL) {
        pthread_mutex_lock(&c->mu);
        n = c->limit;
        pthread_mutex_unlock(&c->mu);
    }
    return PyLong_FromLong(n);
}

/* Lowering the limit starts no read until fewer than it are in flight; raising it starts more at once. With
 * the GIL held throughout: a close() that has not set `closed` has not begun, so the core is there. */
static int set_limit(Engine *self, PyObject *value, void *_)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "limit cannot be deleted");
        return -1;
    }
    long n = PyLong_AsLong(value);
    if (n == -1 && PyErr_Occurred())
        return -1;
    if (!usable(self))
        return -1;
    struct core *c = self->c;
    if (n < 1 || n > c->depth) {
        PyErr_Format(PyExc_ValueError, "limit=%ld: pass 1..%d (the engine's depth)", n, c->depth);
        return -1;
    }
    pthread_mutex_lock(&c->mu);
    int raised = n > c->limit;
    c->limit = (int)n;
    if (raised)
        pthread_cond_broadcast(&c->work);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

static PyObject *get_closed(Engine *self, void *_) { return PyBool_FromLong(self->closed); }
static PyObject *get_leaked(Engine *self, void *_) { return PyBool_FromLong(self->leaked); }

static PyObject *get_note(Engine *self, void *_)
{
    if (self->note == NULL)
        Py_RETURN_NONE;
    Py_INCREF(self->note);
    return self->note;
}

static PyObject *get_inflight(Engine *self, void *_)
{
    struct core *c = kept(self);
    int64_t n = 0;
    if (c != NULL) {
        pthread_mutex_lock(&c->mu);
        n = in_flight(c);
        pthread_mutex_unlock(&c->mu);
    }
    return PyLong_FromLongLong((long long)n);
}

static PyObject *get_queued(Engine *self, void *_)
{
    struct core *c = kept(self);
    long n = 0;
    if (c != NULL) {
        pthread_mutex_lock(&c->mu);
        n = (long)c->count;
        pthread_mutex_unlock(&c->mu);
    }
    return PyLong_FromLong(n);
}

static PyGetSetDef Engine_getset[] = {
    {"mode", (getter)get_mode, NULL, "\"io_uring\" or \"threads\" (\"closed\" once closed)", NULL},
    {"depth", (getter)get_depth, NULL, "reads kept in flight", NULL},
    {"fixed", (getter)get_fixed, NULL, "io_uring: the pool is a registered buffer (READ_FIXED)", NULL},
    {"ext_arg", (getter)get_ext_arg, NULL, "io_uring: waits with IORING_ENTER_EXT_ARG (else poll on the ring fd)",
     NULL},
    {"note", (getter)get_note, NULL, "one line on how it reads", NULL},
    {"limit", (getter)get_limit, (setter)set_limit,
     "reads the engine may have in flight now, 1..depth (lowered: those in flight drain to it); 0 once closed",
     NULL},
    {"inflight", (getter)get_inflight, NULL, "reads in flight now", NULL},
    {"queued", (getter)get_queued, NULL, "batches queued (submitted, not yet waited for or drained)", NULL},
    {"closed", (getter)get_closed, NULL, "close() was called", NULL},
    {"leaked", (getter)get_leaked, NULL, "close() left the ring/threads and the pool to reads still in flight", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Engine_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))Engine_submit, METH_FASTCALL,
     "submit(fds, file_offsets, pool_offsets, lengths, needs, timeout_s) -> OK, or BUSY (nothing queued)"},
    {"wait", (PyCFunction)Engine_wait, METH_O,
     "wait(timeout_s) -> (status, run, detail, bytes, reads) of the oldest batch queued"},
    {"read", (PyCFunction)(void (*)(void))Engine_read, METH_FASTCALL,
     "read(fds, file_offsets, pool_offsets, lengths, needs, timeout_s) -> (status, run, detail, bytes, reads)"},
    {"drain", (PyCFunction)Engine_drain, METH_O,
     "drain(timeout_s) -> reads still in flight after abandoning every batch queued and waiting (0: empty)"},
    {"close", (PyCFunction)(void (*)(void))Engine_close, METH_FASTCALL,
     "close(timeout_s=0) -> True when freed, False when reads still in flight leave it leaked"},
    {"_fault", (PyCFunction)(void (*)(void))Engine_fault, METH_FASTCALL,
     "_fault(file_offset, code): tests only; code errno: fail reads covering the byte, -1: hold them, 0: clear"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tableserver.disk._diskio.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Engine(mode, depth, pool): reads batches of runs into the page pool (see tableserver/disk/_diskio.c)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_getset = Engine_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tableserver.disk._diskio",
                                    "The native read engine of tableserver.disk.reader (io_uring or pthreads).", -1,
                                    NULL};

PyMODINIT_FUNC PyInit__diskio(void)
{
    if (PyType_Ready(&EngineType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
    static int atfork_done;
    if (!atfork_done && pthread_atfork(NULL, NULL, after_fork_child) == 0)
        atfork_done = 1;
    if (PyModule_AddIntConstant(m, "OK", ST_OK) || PyModule_AddIntConstant(m, "ERROR", ST_ERROR) ||
        PyModule_AddIntConstant(m, "SHORT", ST_SHORT) || PyModule_AddIntConstant(m, "TIMEOUT", ST_TIMEOUT) ||
        PyModule_AddIntConstant(m, "BUSY", ST_BUSY) || PyModule_AddIntConstant(m, "CUT", ST_CUT) ||
        PyModule_AddIntConstant(m, "MAX_DEPTH", MAX_DEPTH) || PyModule_AddIntConstant(m, "MAX_QUEUED", MAX_QUEUED)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
