/* tableserver/disk/_diskio_c/module.c: the module tableserver.disk._diskio -- the Python type Engine (its calls,
 * close, the getters and the settable limit), the core's release and the module's init. The engine it drives:
 * queue.c (the batch queue), threads.c (the "threads" engine), uring.c (the "io_uring" engine); what they
 * share: engine.h.
 *
 * tableserver.disk._diskio: the native read engine behind tableserver.disk.reader.DiskTable's page plan.
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
#include "engine.h"

#include "bufcheck.h"

static unsigned long fork_gen; /* bumped in a forked child: an engine belongs to the process that made it */

static void after_fork_child(void) { fork_gen++; }

/* -- the core ---------------------------------------------------------------------------------------- */

static void core_free(struct core *c)
{
    if (c->nthreads)
        diskio_threads_stop(c, 1);
    if (c->mode == MODE_URING)
        diskio_ring_free(&c->ring);
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
        e = diskio_ring_init(&c->ring, (unsigned)depth);
        Py_END_ALLOW_THREADS
        if (e < 0) {
            errno = -e;
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, "io_uring_setup");
            goto fail;
        }
        int err;
        Py_BEGIN_ALLOW_THREADS
        err = diskio_ring_register(&c->ring, c->pool, c->pool_len);
        Py_END_ALLOW_THREADS
        if (err == 0) {
            c->fixed = 1;
            self->note = PyUnicode_FromString("page pool registered (READ_FIXED)");
        } else {
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
    e = diskio_threads_start(c, m == MODE_URING ? 1 : depth, m == MODE_URING ? diskio_driver : diskio_worker);
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
    st = full ? ST_OK : diskio_enqueue(c, a, n, deadline);
    if (st == ST_BUSY) {
        r[0] = ST_BUSY;
        r[2] = diskio_in_flight(c);
    } else if (st == ST_OK && !full && and_wait) {
        diskio_wait_head(c, deadline, r);
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
        diskio_wait_head(c, deadline_after(timeout), r);
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
    left = diskio_drain(c, deadline_after(timeout));
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
        left = diskio_drain(c, deadline);
        pthread_mutex_unlock(&c->mu);
    }
    if (!left)
        core_free(c); /* joins the threads: they are idle */
    else
        diskio_threads_stop(c, 0); /* idle threads exit, a stalled one once its read is back; the core stays */
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
        n = diskio_in_flight(c);
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
    .tp_doc = "Engine(mode, depth, pool): reads batches of runs into the page pool (see tableserver/disk/_diskio_c/module.c)",
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
