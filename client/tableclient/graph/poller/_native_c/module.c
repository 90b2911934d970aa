/* client/tableclient/graph/poller/_native_c/module.c: the module tableclient.graph.poller._native -- the Python
 * type Poller (its init and stop, arm, the waits, the handoffs' Python side, the events, the getters),
 * stand_in and the module's init. The thread a Poller starts: loop.c (its tcp gather: tcp.c); its sources,
 * set from Python: source.c; what they share: poller.h; the wire's constants: wire.h.
 *
 * tableclient.graph.poller._native: the in_graph layers' poller and watchdog in one native thread per GraphStep
 * (see client/tableclient/graph/step.py for the flag protocol; docs/DESIGN.md for why).
 *
 * Poller(flags, slots, fail, realtime=False, dead_id=None, cpu=-1)
 *   flags: the GraphStep's pinned uint32 flags (writable, 4-byte aligned)
 *   slots: a list of (ids_flag, rows_flag, ok_flag, ids, staging, row_bytes, columns), one per in_graph layer
 *          in the order to serve them (shortest window first): ok_flag -1 for none; ids a writable int64
 *          buffer of max_tokens * columns; staging a writable uint8 buffer of max_tokens * columns * row_bytes
 *   fail:  policy fail (a failed step is also reported by wait_released) rather than zeros
 *   realtime: run the thread at SCHED_FIFO priority 1 where this process may (CAP_SYS_NICE, or an
 *          RLIMIT_RTPRIO above 0); ``Poller.realtime`` says whether it does. A spinning thread of normal
 *          priority is preempted now and then for a scheduler slice (milliseconds: a step's tail) on a
 *          machine whose cores are all busy; at priority 1 it is not, and it spins only while armed (the
 *          kernel's real-time throttling still leaves other threads 5% of its core)
 *   dead_id: an engine's marker for padding (vLLM's DEAD_ID): ids equal to it are never read nor sent, their
 *          rows are zero (every other id outside the table fails the step)
 *   cpu:   pin the thread to this CPU (-1: wherever the scheduler puts it), for a core kept free of the
 *          engine's other threads: no migration, no other thread's slice mid-step; ``Poller.cpu`` says the
 *          CPU it runs on, -1 where the pin was refused (a CPU outside this process's cpuset)
 * The thread is named "graph-poller" (ps -L, top -H).
 * set_shm(slot, table, rows)    the slot's rows are copied from ``table`` (a 2-D uint8 mapping, rows x row_bytes)
 * set_tcp(slot, fd, table_index, max_rows)
 *                               the slot's rows come over ``fd``, an authenticated, unsealed data connection
 *                               speaking the tcp wire protocol (tableserver/common/wire.py); the poller dups
 *                               it and owns the dup
 * set_rdma(slot, endpoint)      the slot's rows are RDMA READs through ``endpoint``, a connected
 *                               tableclient.graph.poller._verbs.Endpoint of its own (one RC QP reading the slot's
 *                               table, rows of its row_bytes, max_tokens x columns of them per step; the
 *                               poller keeps a reference until the slot's source changes). That module, built
 *                               only where libibverbs is, hands its functions over in a capsule
 *                               (verbs.h): this one neither includes nor links libibverbs
 * set_host(slot)                the slot's steps are handed to Python (take_handoff/finish_handoff): a source
 *                               this thread cannot read (a sealed connection, a disk-tier or packed-only table,
 *                               rows split over shards) or one being connected again, read by the client's
 *                               own transport meanwhile
 * set_none(slot)                no source (a node down): its steps get the policy at once
 * arm(tokens, deadlines)        every slot: the next step has ``tokens`` tokens, its ids due by deadlines[i]
 *                               (CLOCK_MONOTONIC seconds, time.monotonic()'s clock)
 * set_budget(slot, seconds)     a gather must end this long after its ids were seen (and by the step's
 *                               deadline): past it the policy, as at the deadline (0: the deadline alone)
 * busy() -> bool                a slot not yet released and consumed (rows flag back to 0), or owing ids
 * wait_released(timeout) -> list|None
 *                               waits (without the GIL) until no slot is armed or gathering; the errors of
 *                               the step's failed slots as (slot, message), or None on timeout
 * reset()                       every slot idle, flags 0 (after a replay that may not have run); once closed,
 *                               nothing (the flags stay released: a replay waits for nobody)
 * take_events() -> list         (slot, seconds from ids seen to release (0: never seen), how, rows zeroed)
 *                               of the steps released since the last call, how: 0 rows, 1 policy after an error,
 *                               2 the deadline before the graph's ids came (watchdog), 3 a replay nobody armed,
 *                               4 the deadline after its ids came: a remote source (tcp, rdma, the client's
 *                               transport) did not answer in time (never a mapped table: its copy cannot be late)
 * broken(slot) -> str|None      why the slot's connection broke (Python connects again, off the hot path)
 * poll_closed(slot) -> bool     whether the server closed the slot's idle tcp connection (its idle timeout):
 *                               the connection is then dropped (broken() says so), never written to
 * take_handoff(timeout) -> (slot, step, tokens, deadline)|None
 *                               (without the GIL) a step handed to Python: a slot whose source is set_host, or
 *                               whose connection the server had closed before a byte of the step's response came
 *                               (reads are idempotent: the client's transport sends it again); Python gathers
 *                               its rows into the slot's staging by ``deadline`` (time.monotonic()'s clock) and
 *                               calls finish_handoff. A handoff nobody took by its deadline gets the policy here
 * finish_handoff(slot, step, ok, error, timed_out) -> bool
 *                               releases a step taken with take_handoff: its rows (``ok``), or the policy's
 *                               (zeros; ``error`` the one-line why, ``timed_out``: by its deadline); False when
 *                               the step is no longer that one (reset or closed meanwhile)
 * close()                       stops the thread; every rows flag set (a replay after it waits for nobody)
 *
 * released_at(slot) -> float   when the slot's last step was released (time.monotonic()'s clock)
 *
 * stand_in(flags, ids_flag, rows_flag, timeout) -> (published, seconds) | None
 *   what a replayed graph does at one in_graph layer, natively and without the GIL (a stand-in for the GPU
 *   where there is none: bench/bench_graph.py's wake stage): sets the ids flag (at ``published``,
 *   time.monotonic()'s clock), waits for the rows flag and returns the seconds until it saw it, measured
 *   before the GIL is taken back; None past timeout.
 *   Like a GPU it takes (almost) no core from the host while it waits: it naps STAND_IN_NAP_NS between
 *   looks, so what it returns may exceed the true time by about one nap (the poller's released_at() has
 *   the release itself).
 *
 * The thread, and why it is built as it is: the top of loop.c.
 */
#include "poller.h"

#define STAND_IN_NAP_NS 100000

static void poller_release_buffers(Poller *p)
{
    for (int i = 0; i < p->nslots; i++) {
        Slot *s = &p->slots[i];
        PyBuffer_Release(&s->ids);
        PyBuffer_Release(&s->staging);
        PyMem_RawFree(s->live);
        PyMem_RawFree(s->pos);
        s->live = s->pos = NULL;
        if (s->have_table)
            PyBuffer_Release(&s->table);
        s->have_table = 0;
        Py_CLEAR(s->endpoint);
        s->ep = NULL;
    }
    p->nslots = 0;
    if (p->flags_buf.obj)
        PyBuffer_Release(&p->flags_buf);
}

/* Stops the thread, once (a second caller, or one racing the first, returns at once: ``stopping`` is set with
 * the GIL held); every slot's source let go under the lock, so a set_* racing it (its GIL released) either
 * swapped before, and its source is let go here, or finds the poller closed and lets its own go. */
static void stop(Poller *p)
{
    if (!p->started || p->stopping)
        return;
    p->stopping = 1;
    PyObject *endpoints[MAX_SLOTS];
    Py_buffer tables[MAX_SLOTS];
    int had_table[MAX_SLOTS];
    int n = p->nslots;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->lock);
    __atomic_store_n(&p->closed, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
    pthread_join(p->thread, NULL);
    pthread_mutex_lock(&p->lock);
    for (int i = 0; i < n; i++) {
        Slot *s = &p->slots[i];
        if (s->handoff == HANDOFF_PENDING) { /* nobody takes it now: the stream waits for nobody (below) */
            __atomic_store_n(&s->handoff, HANDOFF_NONE, __ATOMIC_RELEASE);
            SET_STATE(s, RELEASED);
        }
        store(p, s->rows_flag, 1); /* a graph replayed after this waits for nobody */
        drop_source(s);
        endpoints[i] = take_endpoint(s); /* the thread is gone: nothing gathers through it */
        had_table[i] = take_table(s, &tables[i]); /* nor copies from it: the mapping is let go now, not when
                                                     the Poller is freed (a node's memory, unmapped) */
        s->source = SRC_NONE;
    }
    pthread_cond_broadcast(&p->changed); /* take_handoff's waiters: closed */
    pthread_mutex_unlock(&p->lock);
    Py_END_ALLOW_THREADS
    for (int i = 0; i < n; i++) {
        Py_XDECREF(endpoints[i]);
        if (had_table[i])
            PyBuffer_Release(&tables[i]);
    }
    p->started = 0;
}

static void Poller_dealloc(Poller *p)
{
    stop(p);
    poller_release_buffers(p);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->changed);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static int Poller_init(Poller *p, PyObject *args, PyObject *kw)
{
    PyObject *flags, *slots, *dead = Py_None;
    int fail, realtime = 0, cpu = -1;
    static char *names[] = {"flags", "slots", "fail", "realtime", "dead_id", "cpu", NULL};
    if (p->nslots || p->started) {
        PyErr_SetString(PyExc_RuntimeError, "a Poller is initialized once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOp|pOi", names, &flags, &slots, &fail, &realtime, &dead, &cpu))
        return -1;
    if (cpu < -1 || cpu >= CPU_SETSIZE) {
        PyErr_Format(PyExc_ValueError, "cpu %d: use -1 (not pinned) or a CPU number below %d", cpu, CPU_SETSIZE);
        return -1;
    }
    p->want_rt = realtime;
    p->want_cpu = cpu;
    p->cpu = -1;
    if (dead != Py_None) {
        p->dead_id = PyLong_AsLongLong(dead);
        if (p->dead_id == -1 && PyErr_Occurred())
            return -1;
        p->has_dead = 1;
    }
    if (PyObject_GetBuffer(flags, &p->flags_buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = p->flags_buf.format;
    if (f && (*f == '@' || *f == '=' || *f == '<'))
        f++;
    if (p->flags_buf.itemsize != 4 || !f || (f[0] != 'I' && f[0] != 'L') || f[1] || ((uintptr_t)p->flags_buf.buf & 3)) {
        PyErr_SetString(PyExc_TypeError, "flags must be a 4-byte aligned buffer of native uint32");
        goto fail;
    }
    p->flags = p->flags_buf.buf;
    p->nflags = p->flags_buf.len / 4;
    p->fail = fail;
    Py_ssize_t n = PySequence_Length(slots);
    if (n < 0)
        goto fail;
    if (n < 1 || n > MAX_SLOTS) {
        PyErr_Format(PyExc_ValueError, "1 to %d slots", MAX_SLOTS);
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_GetItem(slots, i);
        if (!t)
            goto fail;
        Slot *s = &p->slots[i];
        long ids_flag, rows_flag, ok_flag;
        Py_ssize_t row_bytes, columns;
        PyObject *ids, *staging;
        int okp = PyArg_ParseTuple(t, "lllOOnn", &ids_flag, &rows_flag, &ok_flag, &ids, &staging, &row_bytes, &columns);
        Py_DECREF(t);
        if (!okp)
            goto fail;
        if (PyObject_GetBuffer(ids, &s->ids, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto fail;
        if (PyObject_GetBuffer(staging, &s->staging, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&s->ids);
            goto fail;
        }
        p->nslots = (int)i + 1; /* its buffers are released with the others from here on */
        s->fd = -1;
        if (!is_int64(&s->ids) || row_bytes < 1 || columns < 1 || ids_flag < 0 || rows_flag < 0 ||
            ids_flag >= p->nflags || rows_flag >= p->nflags || ok_flag >= p->nflags || ok_flag < -1) {
            PyErr_SetString(PyExc_ValueError, "a slot's ids are not int64, or its flags are outside the flags");
            goto fail;
        }
        s->ids_flag = (uint32_t)ids_flag;
        s->rows_flag = (uint32_t)rows_flag;
        s->ok_flag = (int32_t)ok_flag;
        s->row_bytes = (size_t)row_bytes;
        s->columns = (size_t)columns;
        s->max_tokens = (size_t)(s->ids.len / 8) / s->columns;
        size_t ids_n, staging_n, live_n; /* every product checked: a wrapped size would pass the comparison */
        if (!s->max_tokens || s->max_tokens > INT32_MAX ||
            __builtin_mul_overflow(s->max_tokens, s->columns, &ids_n) ||
            __builtin_mul_overflow(ids_n, s->row_bytes, &staging_n) ||
            __builtin_mul_overflow(ids_n, sizeof(int64_t), &live_n) || (size_t)s->staging.len < staging_n) {
            PyErr_SetString(PyExc_ValueError, "a slot's staging is smaller than its ids' rows");
            goto fail;
        }
        if (p->has_dead) {
            s->live = PyMem_RawMalloc(live_n);
            s->pos = PyMem_RawMalloc(live_n);
            if (!s->live || !s->pos) {
                PyErr_NoMemory();
                goto fail;
            }
        }
    }
    p->started = 1;
    if (pthread_create(&p->thread, NULL, poller_run, p) != 0) {
        p->started = 0;
        PyErr_SetString(PyExc_OSError, "cannot start the poller's thread");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->lock);
    while (p->started != 2) /* its priority and CPU are known once it runs */
        pthread_cond_wait(&p->changed, &p->lock);
    pthread_mutex_unlock(&p->lock);
    Py_END_ALLOW_THREADS
    return 0;
fail:
    poller_release_buffers(p);
    return -1;
}

static PyObject *Poller_set_budget(Poller *p, PyObject *args)
{
    PyObject *slot_o;
    double seconds;
    int i;
    if (!PyArg_ParseTuple(args, "Od", &slot_o, &seconds) || check_slot(p, slot_o, &i) < 0)
        return NULL;
    if (!(seconds >= 0) || seconds > 1e6) {
        PyErr_SetString(PyExc_ValueError, "a budget of 0 to 1e6 seconds");
        return NULL;
    }
    pthread_mutex_lock(&p->lock);
    p->slots[i].budget_ns = (int64_t)(seconds * 1e9);
    pthread_mutex_unlock(&p->lock);
    Py_RETURN_NONE;
}

static int is_busy(Poller *p)
{
    for (int i = 0; i < p->nslots; i++) {
        Slot *s = &p->slots[i];
        if ((s->state != IDLE && s->state != RELEASED) || s->owe || load(p, s->rows_flag) != 0)
            return 1;
    }
    return 0;
}

static PyObject *Poller_arm(Poller *p, PyObject *args)
{
    int tokens;
    PyObject *deadlines;
    if (!PyArg_ParseTuple(args, "iO", &tokens, &deadlines))
        return NULL;
    int64_t due[MAX_SLOTS];
    if (PySequence_Length(deadlines) != p->nslots) {
        PyErr_SetString(PyExc_ValueError, "one deadline a slot");
        return NULL;
    }
    for (int i = 0; i < p->nslots; i++) {
        PyObject *d = PySequence_GetItem(deadlines, i);
        double v = d ? PyFloat_AsDouble(d) : -1;
        Py_XDECREF(d);
        if (PyErr_Occurred())
            return NULL;
        if (v != v) {
            PyErr_SetString(PyExc_ValueError, "a deadline of nan: use time.monotonic() seconds");
            return NULL;
        }
        due[i] = seconds_to_ns(v); /* saturated: inf is never, not a wrapped deadline already passed */
        if (tokens < 0 || (size_t)tokens > p->slots[i].max_tokens) {
            PyErr_Format(PyExc_ValueError, "%d tokens in a step, this GraphStep holds %zu", tokens, p->slots[i].max_tokens);
            return NULL;
        }
    }
    int busy;
    pthread_mutex_lock(&p->lock);
    busy = p->closed || !p->started || is_busy(p);
    if (!busy) {
        for (int i = 0; i < p->nslots; i++) {
            Slot *s = &p->slots[i];
            s->tokens = tokens;
            s->deadline_ns = due[i];
            s->failed = 0;
            s->error[0] = 0;
            s->step++;
            SET_STATE(s, ARMED);
        }
        pthread_cond_broadcast(&p->changed); /* the thread, napping, starts spinning now */
    }
    pthread_mutex_unlock(&p->lock);
    if (busy) {
        PyErr_SetString(PyExc_RuntimeError, "the last step is not released and consumed (or the poller is closed)");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Poller_busy(Poller *p, PyObject *unused)
{
    pthread_mutex_lock(&p->lock);
    int busy = is_busy(p);
    pthread_mutex_unlock(&p->lock);
    return PyBool_FromLong(busy);
}

/* now + seconds, saturated (an infinite timeout waits for ever, never for a wrapped negative time) */
static int64_t after(double seconds)
{
    int64_t now = now_ns(), ns = seconds_to_ns(seconds);
    return ns > INT64_MAX - now ? INT64_MAX : now + ns;
}

/* a timeout argument in seconds; -1 with ValueError for NaN */
static int timeout_arg(PyObject *arg, double *out)
{
    *out = PyFloat_AsDouble(arg);
    if (*out == -1 && PyErr_Occurred())
        return -1;
    if (*out != *out) {
        PyErr_SetString(PyExc_ValueError, "a timeout of nan: use seconds >= 0");
        return -1;
    }
    return 0;
}

static PyObject *Poller_wait_released(Poller *p, PyObject *arg)
{
    double timeout;
    if (timeout_arg(arg, &timeout) < 0)
        return NULL;
    int done = 0;
    char errors[MAX_SLOTS][ERROR_CHARS];
    int failed[MAX_SLOTS];
    Py_BEGIN_ALLOW_THREADS
    int64_t end = after(timeout);
    pthread_mutex_lock(&p->lock);
    for (;;) {
        done = 1;
        for (int i = 0; i < p->nslots; i++)
            done &= p->slots[i].state != ARMED && p->slots[i].state != GATHERING;
        if (done || p->closed || now_ns() >= end)
            break;
        int64_t left = end - now_ns();
        nap_on(p, left < 1000000 ? left : 1000000); /* a millisecond at most: the wait is bounded by end */
    }
    for (int i = 0; i < p->nslots; i++) {
        failed[i] = p->slots[i].failed;
        memcpy(errors[i], p->slots[i].error, ERROR_CHARS);
    }
    pthread_mutex_unlock(&p->lock);
    Py_END_ALLOW_THREADS
    if (!done)
        Py_RETURN_NONE;
    PyObject *out = PyList_New(0);
    for (int i = 0; out && i < p->nslots; i++) {
        if (!failed[i])
            continue;
        PyObject *t = Py_BuildValue("(is)", i, errors[i]);
        if (!t || PyList_Append(out, t) < 0)
            Py_CLEAR(out);
        Py_XDECREF(t);
    }
    return out;
}

static PyObject *Poller_reset(Poller *p, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->lock);
    for (int i = 0; i < p->nslots && !p->closed; i++) { /* closed: the flags stay released (nobody waits) */
        Slot *s = &p->slots[i];
        if (s->handoff == HANDOFF_PENDING) { /* not taken: nobody writes its staging now */
            __atomic_store_n(&s->handoff, HANDOFF_NONE, __ATOMIC_RELEASE);
            SET_STATE(s, IDLE);
        }
        wait_not_gathering(p, s); /* a handoff Python took ends by its deadline (finish_handoff) */
        SET_STATE(s, IDLE);
        s->owe = 0;
        s->failed = 0;
        s->step++; /* nothing decided before the reset applies after it */
        store(p, s->ids_flag, 0);
        store(p, s->rows_flag, 0);
    }
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Poller_take_events(Poller *p, PyObject *unused)
{
    Event copy[MAX_EVENTS];
    pthread_mutex_lock(&p->lock);
    int n = p->nevents;
    memcpy(copy, p->events, sizeof(Event) * (size_t)n);
    p->nevents = 0;
    pthread_mutex_unlock(&p->lock);
    PyObject *out = PyList_New(n);
    for (int i = 0; out && i < n; i++) {
        PyObject *t = Py_BuildValue("(idiL)", copy[i].slot, copy[i].seconds, copy[i].how, copy[i].zeroed);
        if (!t)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, t);
    }
    return out;
}

static PyObject *Poller_broken(Poller *p, PyObject *slot_o)
{
    int i;
    if (check_slot(p, slot_o, &i) < 0)
        return NULL;
    char why[ERROR_CHARS];
    pthread_mutex_lock(&p->lock);
    memcpy(why, p->slots[i].broken, ERROR_CHARS);
    p->slots[i].broken[0] = 0; /* said once */
    pthread_mutex_unlock(&p->lock);
    if (!why[0])
        Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(why, (Py_ssize_t)strnlen(why, ERROR_CHARS), "replace");
}

static PyObject *Poller_poll_closed(Poller *p, PyObject *slot_o)
{
    int i;
    if (check_slot(p, slot_o, &i) < 0)
        return NULL;
    Slot *s = &p->slots[i];
    int closed = 0;
    pthread_mutex_lock(&p->lock);
    if (s->source == SRC_TCP && s->state != GATHERING) { /* a gather in progress finds out itself */
        closed = poller_peer_closed(s->fd);
        if (closed) {
            snprintf(s->error, ERROR_CHARS, "%s",
                     closed > 0 ? "the server closed the idle connection" : "bytes nobody asked for on the connection");
            break_source(s, closed > 0); /* closed: the client's transport reads its steps until it has another */
        }
    }
    pthread_mutex_unlock(&p->lock);
    return PyBool_FromLong(closed != 0);
}

static PyObject *Poller_take_handoff(Poller *p, PyObject *arg)
{
    double timeout;
    if (timeout_arg(arg, &timeout) < 0)
        return NULL;
    int found = -1, tokens = 0;
    uint64_t step = 0;
    int64_t deadline = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t end = after(timeout);
    pthread_mutex_lock(&p->lock);
    for (;;) {
        for (int i = 0; i < p->nslots && found < 0; i++) {
            Slot *s = &p->slots[i];
            if (s->state == GATHERING && s->handoff == HANDOFF_PENDING) {
                __atomic_store_n(&s->handoff, HANDOFF_TAKEN, __ATOMIC_RELEASE); /* Python's until finish_handoff */
                found = i;
                tokens = s->tokens;
                step = s->step;
                deadline = s->handoff_deadline;
            }
        }
        int64_t left = end - now_ns();
        if (found >= 0 || p->closed || left <= 0)
            break;
        nap_on(p, left < 50000000 ? left : 50000000);
    }
    pthread_mutex_unlock(&p->lock);
    Py_END_ALLOW_THREADS
    if (found < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(iKid)", found, (unsigned long long)step, tokens, deadline * 1e-9);
}

static PyObject *Poller_finish_handoff(Poller *p, PyObject *args)
{
    PyObject *slot_o;
    unsigned long long step;
    int ok, timed_out, i;
    const char *why;
    if (!PyArg_ParseTuple(args, "OKpsp", &slot_o, &step, &ok, &why, &timed_out) || check_slot(p, slot_o, &i) < 0)
        return NULL;
    Slot *s = &p->slots[i];
    int released = 0;
    pthread_mutex_lock(&p->lock);
    if (s->step == step && s->state == GATHERING && s->handoff == HANDOFF_TAKEN) {
        __atomic_store_n(&s->handoff, HANDOFF_NONE, __ATOMIC_RELEASE);
        s->timed_out = !ok && timed_out;
        if (!ok) {
            snprintf(s->error, ERROR_CHARS, "%s", why);
            fill_policy(s, s->tokens);
            s->failed = 1;
        }
        release_slot(p, s, ok);
        event(p, i, ok ? HOW_ROWS : s->timed_out ? HOW_LATE : HOW_POLICY, s->handoff_seen,
              ok ? 0 : (long long)((size_t)s->tokens * s->columns));
        released = 1;
    }
    pthread_mutex_unlock(&p->lock);
    return PyBool_FromLong(released);
}

static PyObject *Poller_released_at(Poller *p, PyObject *slot_o)
{
    int i;
    if (check_slot(p, slot_o, &i) < 0)
        return NULL;
    pthread_mutex_lock(&p->lock);
    int64_t t = p->slots[i].released_ns;
    pthread_mutex_unlock(&p->lock);
    return PyFloat_FromDouble(t * 1e-9);
}

static PyObject *Poller_close(Poller *p, PyObject *unused)
{
    stop(p);
    Py_RETURN_NONE;
}

static PyObject *stand_in(PyObject *module, PyObject *args)
{
    PyObject *flags;
    Py_ssize_t ids_flag, rows_flag;
    double timeout;
    if (!PyArg_ParseTuple(args, "Onnd", &flags, &ids_flag, &rows_flag, &timeout))
        return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(flags, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (b.itemsize != 4 || ((uintptr_t)b.buf & 3) || ids_flag < 0 || rows_flag < 0 || ids_flag >= b.len / 4 ||
        rows_flag >= b.len / 4 || !(timeout >= 0)) { /* NaN too */
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "flags must be aligned uint32 holding both indices; timeout >= 0");
        return NULL;
    }
    volatile uint32_t *f = b.buf;
    int64_t took = -1, published = 0;
    struct timespec nap = {0, STAND_IN_NAP_NS};
    Py_BEGIN_ALLOW_THREADS
    int64_t t0 = now_ns(), end = after(timeout);
    published = t0;
    __atomic_store_n(&f[ids_flag], 1, __ATOMIC_RELEASE);
    for (;;) {
        int64_t t = now_ns();
        if (__atomic_load_n(&f[rows_flag], __ATOMIC_ACQUIRE) == 1) {
            took = t - t0;
            break;
        }
        if (t >= end)
            break;
        nanosleep(&nap, NULL);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    if (took < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(dd)", published * 1e-9, took * 1e-9);
}

static PyMethodDef module_methods[] = {
    {"stand_in", (PyCFunction)stand_in, METH_VARARGS,
     "stand_in(flags, ids_flag, rows_flag, timeout) -> seconds from the ids flag set to the rows flag seen, or None"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef Poller_methods[] = {
    {"set_shm", (PyCFunction)Poller_set_shm, METH_VARARGS, "set_shm(slot, table, rows): rows copied from a mapping"},
    {"set_tcp", (PyCFunction)Poller_set_tcp, METH_VARARGS,
     "set_tcp(slot, fd, table_index, max_rows): rows over an authenticated, unsealed data connection (dup'd)"},
    {"set_rdma", (PyCFunction)Poller_set_rdma, METH_VARARGS,
     "set_rdma(slot, endpoint): rows READ through a connected tableclient.graph.poller._verbs.Endpoint (kept)"},
    {"set_host", (PyCFunction)Poller_set_host, METH_O,
     "set_host(slot): its steps handed to Python (take_handoff), read by the client's own transport"},
    {"set_none", (PyCFunction)Poller_set_none, METH_O, "set_none(slot): no source; its steps get the policy"},
    {"poll_closed", (PyCFunction)Poller_poll_closed, METH_O,
     "poll_closed(slot) -> whether the server closed its idle tcp connection (then dropped; broken() says why)"},
    {"take_handoff", (PyCFunction)Poller_take_handoff, METH_O,
     "take_handoff(timeout) -> (slot, step, tokens, deadline) of a step handed to Python, or None"},
    {"finish_handoff", (PyCFunction)Poller_finish_handoff, METH_VARARGS,
     "finish_handoff(slot, step, ok, error, timed_out) -> whether it released that step"},
    {"set_budget", (PyCFunction)Poller_set_budget, METH_VARARGS,
     "set_budget(slot, seconds): a gather ends this long after its ids were seen, or gets the policy"},
    {"arm", (PyCFunction)Poller_arm, METH_VARARGS, "arm(tokens, deadlines): the next step of every slot"},
    {"busy", (PyCFunction)Poller_busy, METH_NOARGS, "busy() -> whether the last step is not released and consumed"},
    {"wait_released", (PyCFunction)Poller_wait_released, METH_O,
     "wait_released(timeout) -> [(slot, error)] of the failed slots once none is armed or gathering, None on timeout"},
    {"reset", (PyCFunction)Poller_reset, METH_NOARGS, "reset(): every slot idle and its flags 0"},
    {"take_events", (PyCFunction)Poller_take_events, METH_NOARGS,
     "take_events() -> [(slot, seconds, how, zeroed)] of the steps released since the last call"},
    {"broken", (PyCFunction)Poller_broken, METH_O,
     "broken(slot) -> why its connection broke since the last call (said once), or None"},
    {"released_at", (PyCFunction)Poller_released_at, METH_O,
     "released_at(slot) -> when its last step was released (time.monotonic()'s clock)"},
    {"close", (PyCFunction)Poller_close, METH_NOARGS, "close(): stops the thread and sets every rows flag"},
    {NULL, NULL, 0, NULL},
};

static PyObject *Poller_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    Poller *p = (Poller *)type->tp_alloc(type, 0);
    if (p) {
        pthread_mutex_init(&p->lock, NULL);
        pthread_condattr_t attr; /* timed waits on CLOCK_MONOTONIC: a clock change never stretches them */
        pthread_condattr_init(&attr);
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        pthread_cond_init(&p->changed, &attr);
        pthread_condattr_destroy(&attr);
    }
    return (PyObject *)p;
}

static PyObject *Poller_get_realtime(Poller *p, void *closure)
{
    return PyBool_FromLong(__atomic_load_n(&p->rt, __ATOMIC_ACQUIRE));
}

static PyObject *Poller_get_cpu(Poller *p, void *closure)
{
    return PyLong_FromLong(__atomic_load_n(&p->cpu, __ATOMIC_ACQUIRE));
}

static PyGetSetDef Poller_getset[] = {
    {"realtime", (getter)Poller_get_realtime, NULL, "whether the thread runs at SCHED_FIFO priority", NULL},
    {"cpu", (getter)Poller_get_cpu, NULL, "the CPU the thread is pinned to (-1: not pinned)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PollerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tableclient.graph.poller._native.Poller",
    .tp_basicsize = sizeof(Poller),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The in_graph layers' poller and watchdog: one native thread (see the module's docstring).",
    .tp_new = Poller_new,
    .tp_init = (initproc)Poller_init,
    .tp_dealloc = (destructor)Poller_dealloc,
    .tp_methods = Poller_methods,
    .tp_getset = Poller_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tableclient.graph.poller._native",
                                    "The in_graph layers' poller and watchdog without the GIL (client/tableclient/graph/step.py).",
                                    -1, module_methods};

PyMODINIT_FUNC PyInit__native(void)
{
    if (PyType_Ready(&PollerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&PollerType);
    if (PyModule_AddObject(m, "Poller", (PyObject *)&PollerType) < 0) {
        Py_DECREF(&PollerType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "ROWS", HOW_ROWS);
    PyModule_AddIntConstant(m, "POLICY", HOW_POLICY);
    PyModule_AddIntConstant(m, "WATCHDOG", HOW_WATCHDOG);
    PyModule_AddIntConstant(m, "UNARMED", HOW_UNARMED);
    PyModule_AddIntConstant(m, "LATE", HOW_LATE);
    return m;
}
