/* tableclient.graph.poller._native: the in_graph layers' poller and watchdog in one native thread per GraphStep
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
 *                               (graphverbs.h): this one neither includes nor links libibverbs
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
 * The thread takes no GIL, and no lock while it spins: it reads the slots' states and flags atomically
 * and locks only to change a state (a Python call waiting for the lock never queues behind a spinner).
 * It spins (the CPU's pause hint) while a slot is armed and, at normal priority, for HOT_NS after a step
 * (staying
 * on its CPU between decode steps); otherwise it waits on a condition arm() signals for at most SLEEP_NS (IDLE_SLEEP_NS once
 * idle for IDLE_AFTER_NS) between
 * looks otherwise, so a replay nobody armed is still released with zeros within that. It alone writes the
 * staging, and it releases a step with a release store after the last byte is written, so no byte lands
 * after a release (the cancel barrier) and the watchdog (the same loop) never races a gather: a gather
 * past its deadline stops at the deadline (the socket is polled against it) and the policy is applied.
 * A connection that broke mid-response is never read again (the slot gets the policy until set_tcp).
 * Over rdma the gather (_graphverbs.c) polls its completions against the same deadline; at it, or on any
 * error, it moves its QP to the error state and drains the flush (bounded) before it returns and the step
 * is released, and its READs land in the endpoint's own registered bounce buffer, copied into the staging
 * by this thread after they all completed: no READ answered late can reach the staging. The endpoint is
 * then broken for good (broken() says why, set_rdma connects a new one), as a tcp connection is.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "bufcheck.h"
#include "verbs.h"
#include "rowcopy.h"
#include "spin.h"

#define SLEEP_NS 20000       /* between looks for a replay nobody armed, right after a step */
#define IDLE_SLEEP_NS 1000000 /* the same once no step was armed for IDLE_AFTER_NS */
#define IDLE_AFTER_NS 50000000
#define HOT_NS 20000000 /* spin on for this long after the last armed step (a decode step's gap) */
#define STAND_IN_NAP_NS 100000
#define MAX_SLOTS 64
#define MAX_EVENTS 256
#define ERROR_CHARS 256
#define HEADER_BYTES 24 /* the wire's frame header (tableserver/common/wire.py) */
#define MAX_ERROR_BODY 4096 /* an error frame's message read at most (else the connection is dropped) */
#define REQUESTS_IN_FLIGHT 2 /* tcp: a request sent ahead while the one before is answered (never blocking on it) */

enum { IDLE, ARMED, GATHERING, RELEASED };
enum { SRC_NONE, SRC_SHM, SRC_TCP, SRC_RDMA, SRC_HOST };
enum { HOW_ROWS, HOW_POLICY, HOW_WATCHDOG, HOW_UNARMED, HOW_LATE };
enum { HANDOFF_NONE, HANDOFF_PENDING, HANDOFF_TAKEN }; /* a GATHERING slot's step handed to Python */
#define GATHER_RESEND (-2) /* the server had closed the connection before any byte of the step's response */

typedef struct {
    uint32_t ids_flag, rows_flag;
    int32_t ok_flag;
    int64_t *live;  /* with a dead id: the step's live ids, and where each goes in the staging (pos) */
    int64_t *pos;
    Py_buffer ids, staging, table;
    int have_table;
    PyObject *endpoint; /* SRC_RDMA: a tableclient.graph.poller._verbs.Endpoint (kept until the source changes) */
    void *ep;
    size_t row_bytes, columns, max_tokens;
    /* state, under the poller's lock */
    int state, owe, failed, source, fd, tokens, timed_out, handoff;
    uint64_t step;
    int64_t deadline_ns, released_ns, budget_ns;
    int64_t handoff_seen, handoff_deadline; /* a handed-off step: when its ids came, when it is due */
    uint64_t table_rows, table_index, max_rows, request_id;
    char error[ERROR_CHARS];
    char broken[ERROR_CHARS];
} Slot;

typedef struct {
    int slot, how;
    double seconds;
    long long zeroed; /* rows the policy served as zeros */
} Event;

typedef struct {
    PyObject_HEAD
    Py_buffer flags_buf;
    volatile uint32_t *flags;
    Py_ssize_t nflags;
    Slot slots[MAX_SLOTS];
    int nslots, fail, closed, started, stopping, want_rt, rt, has_dead, want_cpu, cpu;
    int64_t dead_id;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    Event events[MAX_EVENTS];
    int nevents;
} Poller;

/* tableclient.graph.poller._verbs' functions (the rdma source), taken at the first set_rdma */
static const GraphVerbsAPI *verbs_api;


/* the state a slot is in, read by the thread without the lock (written under it, with a release store
 * after everything the state covers: tokens, deadline) */
#define STATE(s) __atomic_load_n(&(s)->state, __ATOMIC_ACQUIRE)
#define SET_STATE(s, v) __atomic_store_n(&(s)->state, (v), __ATOMIC_RELEASE)

static inline uint32_t load(Poller *p, uint32_t i) { return __atomic_load_n(&p->flags[i], __ATOMIC_ACQUIRE); }
static inline void store(Poller *p, uint32_t i, uint32_t v) { __atomic_store_n(&p->flags[i], v, __ATOMIC_RELEASE); }

static void event(Poller *p, int slot, int how, int64_t seen, long long zeroed)
{
    if (p->nevents < MAX_EVENTS)
        p->events[p->nevents++] = (Event){slot, how, seen ? (now_ns() - seen) * 1e-9 : 0.0, zeroed};
}

/* (lock held) the slot's staging rows of this step hold what the policy serves: zeros */
static void fill_policy(Slot *s, int tokens)
{
    size_t n = (tokens > 0 ? (size_t)tokens : s->max_tokens) * s->columns * s->row_bytes; /* <= the staging: init */
    memset(s->staging.buf, 0, n);
}

/* (lock held) the step's rows are in the staging: the graph may copy them */
static void release_slot(Poller *p, Slot *s, int ok)
{
    if (s->ok_flag >= 0)
        store(p, (uint32_t)s->ok_flag, ok ? 1 : 0);
    s->released_ns = now_ns();
    SET_STATE(s, RELEASED);
    store(p, s->rows_flag, 1);
    pthread_cond_broadcast(&p->changed);
}

/* ------------------------------------------------------------------ tcp, against the deadline */
/* Waits for ``events`` on fd until ``deadline``: 0, -ETIMEDOUT past it, -EPIPE on an error, or -errno */
static int wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        int64_t left = deadline - now_ns();
        if (left <= 0)
            return -ETIMEDOUT;
        int64_t ms = left / 1000000 + 1;
        struct pollfd pfd = {fd, events, 0};
        int r = poll(&pfd, 1, ms > 60000 ? 60000 : (int)ms); /* a far deadline: looked at again each minute */
        if (r > 0) {
            if (pfd.revents & (POLLERR | POLLNVAL))
                return -EPIPE;
            return 0;
        }
        if (r < 0 && errno != EINTR)
            return -errno;
    }
}

/* Whether the server closed (or reset) a connection that owes this side nothing: 1 closed (a hang-up, an error,
 * the stream's end), 0 open, -1 bytes nobody asked for are waiting on it (a server out of step). Never reads. */
static int peer_closed(int fd)
{
    struct pollfd pfd = {fd, POLLIN | POLLRDHUP, 0};
    int r;
    do
        r = poll(&pfd, 1, 0);
    while (r < 0 && errno == EINTR);
    if (r <= 0)
        return 0;
    if (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))
        return 1;
    char c;
    ssize_t k = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
        return 1;
    return k > 0 ? -1 : 0;
}

/* Writes one request -- its header, then its n bytes of ids -- from byte *off on, header and ids in one
 * sendmsg where the socket takes both (the server wakes once, as for the Python client's requests). With
 * ``block`` it waits for room until ``deadline`` until all is written; without, it returns -EAGAIN as soon as
 * the socket takes no more (*off says how far it got). 0 once all is written, else -errno (-ETIMEDOUT). */
static int send_request(int fd, const char *header, const char *ids, size_t n, size_t *off, int block,
                        int64_t deadline)
{
    while (*off < HEADER_BYTES + n) {
        struct iovec iov[2];
        int k = 0;
        if (*off < HEADER_BYTES)
            iov[k++] = (struct iovec){(void *)(header + *off), HEADER_BYTES - *off};
        size_t at = *off > HEADER_BYTES ? *off - HEADER_BYTES : 0;
        if (n > at)
            iov[k++] = (struct iovec){(void *)(ids + at), n - at};
        struct msghdr msg = {0};
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)k;
        ssize_t w = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w > 0) {
            *off += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (!block)
                return -EAGAIN;
            int r = wait_fd(fd, POLLOUT, deadline);
            if (r < 0)
                return r;
            continue;
        }
        return w < 0 ? -errno : -EPIPE;
    }
    return 0;
}

/* Reads n bytes by the deadline; *got counts every byte read (of any response of the step) */
static int recv_all(int fd, char *buf, size_t n, int64_t deadline, size_t *got)
{
    while (n) {
        ssize_t r = recv(fd, buf, n, MSG_DONTWAIT);
        if (r > 0) {
            buf += r;
            n -= (size_t)r;
            *got += (size_t)r;
            continue;
        }
        if (r == 0)
            return -ECONNRESET;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int w = wait_fd(fd, POLLIN, deadline);
            if (w < 0)
                return w;
            continue;
        }
        return -errno;
    }
    return 0;
}

static void put_request(char *h, uint64_t request_id, uint32_t table, uint32_t count)
{
    uint16_t type = 2, flags = 0; /* GATHER */
    memcpy(h, "TSQ1", 4);
    memcpy(h + 4, &type, 2);
    memcpy(h + 6, &flags, 2);
    memcpy(h + 8, &request_id, 8);
    memcpy(h + 16, &table, 4);
    memcpy(h + 20, &count, 4);
}

/* (a failed read or write) s->error says why; the step may be sent again elsewhere (GATHER_RESEND) where the
 * server had closed the connection before this side read a byte of the step's responses (its idle timeout, a
 * restart): nothing of the step was read, and reads are idempotent */
static int io_failed(Slot *s, int r, size_t answered, const char *what)
{
    s->timed_out = r == -ETIMEDOUT;
    if (s->timed_out)
        snprintf(s->error, ERROR_CHARS, "%s", what);
    else
        snprintf(s->error, ERROR_CHARS, "%s", strerror(-r));
    return !answered && (r == -ECONNRESET || r == -EPIPE) ? GATHER_RESEND : -1;
}

/* One response: its rows into out (count ids of row_bytes); 0, -1 with the error (*fatal: broken), or
 * GATHER_RESEND */
static int read_response(Slot *s, uint64_t request_id, uint32_t count, char *out, int64_t deadline, int *fatal,
                         size_t *answered)
{
    char h[HEADER_BYTES];
    int r = recv_all(s->fd, h, HEADER_BYTES, deadline, answered);
    if (r < 0) {
        *fatal = 1;
        return io_failed(s, r, *answered, "rows not in place by the deadline (watchdog)");
    }
    uint16_t type, status;
    uint64_t rid;
    uint32_t row_bytes, n;
    memcpy(&type, h + 4, 2);
    memcpy(&status, h + 6, 2);
    memcpy(&rid, h + 8, 8);
    memcpy(&row_bytes, h + 16, 4);
    memcpy(&n, h + 20, 4);
    if (memcmp(h, "TSR1", 4) || type != 2 || rid != request_id) {
        *fatal = 1;
        snprintf(s->error, ERROR_CHARS, "a response no tableserver sends (request %llu)", (unsigned long long)rid);
        return -1;
    }
    if (status != 0) {
        char msg[MAX_ERROR_BODY + 1];
        if (n > MAX_ERROR_BODY || recv_all(s->fd, msg, n, deadline, answered) < 0) {
            *fatal = 1;
            snprintf(s->error, ERROR_CHARS, "the server refused the gather (status %u)", status);
            return -1;
        }
        msg[n] = 0;
        /* the wire's fatal statuses close the connection after the answer */
        *fatal = status == 1 || status == 2 || status == 5 || status == 6 || status == 8;
        snprintf(s->error, ERROR_CHARS, "the server refused the gather (status %u): %.180s", status, msg);
        return -1;
    }
    if (row_bytes != s->row_bytes || n != count) {
        *fatal = 1;
        snprintf(s->error, ERROR_CHARS, "a response of %u rows of %u B for %u of %zu B", n, row_bytes, count,
                 s->row_bytes);
        return -1;
    }
    r = recv_all(s->fd, out, (size_t)count * s->row_bytes, deadline, answered);
    if (r < 0) {
        *fatal = 1;
        return io_failed(s, r, *answered, "rows not in place by the deadline (watchdog)");
    }
    return 0;
}

/* The step's n ids over tcp, at most max_rows a request. A request goes out ahead while the one before is
 * answered (REQUESTS_IN_FLIGHT), but only as far as the socket takes it at once: this thread never waits to
 * send while a response is owed to it (the server may be waiting to write that response, its own buffers
 * full of rows this side does not read: both would wait until the deadline); it reads that response first,
 * then sends the rest. 0; -1 (s->error, *fatal: the connection is not read again); GATHER_RESEND (the server
 * had closed the connection: nothing read, *fatal) */
static int gather_tcp(Slot *s, const int64_t *ids, size_t n, char *out, int64_t deadline, int *fatal)
{
    int closed = peer_closed(s->fd); /* one poll(): the server's idle timeout found before a byte is sent */
    if (closed) {
        *fatal = 1;
        snprintf(s->error, ERROR_CHARS, "%s",
                 closed > 0 ? "the server had closed the connection" : "bytes nobody asked for on the connection");
        return closed > 0 ? GATHER_RESEND : -1;
    }
    size_t chunk = s->max_rows ? s->max_rows : n;
    if (chunk > UINT32_MAX) /* a frame's count is 32 bits */
        chunk = UINT32_MAX;
    size_t nreq = (n + chunk - 1) / chunk, sent = 0, done = 0, off = 0, answered = 0;
    char h[HEADER_BYTES];
    uint64_t first = s->request_id;
    while (done < nreq) {
        while (sent < nreq && sent < done + REQUESTS_IN_FLIGHT) {
            size_t lo = sent * chunk, cnt = n - lo < chunk ? n - lo : chunk;
            put_request(h, first + sent, (uint32_t)s->table_index, (uint32_t)cnt);
            int r = send_request(s->fd, h, (const char *)(ids + lo), cnt * 8, &off, sent == done, deadline);
            if (r == -EAGAIN)
                break; /* a response is owed: read it first (only a request with none owed waits to be sent) */
            if (r < 0) {
                *fatal = 1;
                return io_failed(s, r, answered, "the request not sent by the deadline (watchdog)");
            }
            sent++;
            off = 0;
        }
        size_t lo = done * chunk, cnt = n - lo < chunk ? n - lo : chunk;
        int r = read_response(s, first + done, (uint32_t)cnt, out + lo * s->row_bytes, deadline, fatal, &answered);
        if (r < 0) {
            if (!*fatal && (done + 1 < sent || off)) /* a request in flight or half written: mid-frame */
                *fatal = 1;
            return r;
        }
        done++;
    }
    s->request_id = first + nreq;
    return 0;
}

/* The live rows, read into the staging's first m rows, moved to their places (s->pos, increasing) of the
 * step's n rows, and the dead ids' rows zeroed: backwards, so no row is overwritten before it is moved */
static void spread(Slot *s, size_t m, size_t n)
{
    char *out = s->staging.buf;
    size_t rb = s->row_bytes, end = n;
    for (size_t j = m; j-- > 0;) {
        size_t at = (size_t)s->pos[j];
        if (at + 1 < end)
            memset(out + (at + 1) * rb, 0, (end - at - 1) * rb);
        if (at != j)
            memmove(out + at * rb, out + j * rb, rb);
        end = at;
    }
    if (end)
        memset(out, 0, end * rb);
}

/* ------------------------------------------------------------------ the thread */
/* (lock held) the slot's step goes to Python (take_handoff): its rows read by the client's own transport */
static void hand_off(Poller *p, Slot *s, int64_t seen, int64_t deadline)
{
    s->handoff_seen = seen;
    s->handoff_deadline = deadline;
    __atomic_store_n(&s->handoff, HANDOFF_PENDING, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&p->changed);
}

/* (lock held) the slot's connection is not read again: why in s->broken; ``host``: its steps go to Python
 * until Python points the slot at a new connection (a connection the server closed: the node answers, and the
 * client's transport reconnects), else the policy (a node that did not answer, or broke the protocol) */
static void break_source(Slot *s, int host)
{
    snprintf(s->broken, ERROR_CHARS, "%s", s->error);
    if (s->source == SRC_TCP && s->fd >= 0)
        close(s->fd);
    s->fd = -1;
    s->source = host ? SRC_HOST : SRC_NONE; /* the endpoint is let go by Python, with the GIL (set_* or close) */
    s->ep = NULL;
}

static void serve_ids(Poller *p, int i)
{
    Slot *s = &p->slots[i];
    int64_t seen = now_ns();
    store(p, s->ids_flag, 0);
    pthread_mutex_lock(&p->lock);
    if (s->owe) { /* the late ids of a step the watchdog released before they came */
        s->owe = 0;
        pthread_cond_broadcast(&p->changed);
        pthread_mutex_unlock(&p->lock);
        return;
    }
    if (s->state != ARMED) { /* a replay nobody armed: released with zeros at once, the GPU never hangs */
        fill_policy(s, 0);
        snprintf(s->error, ERROR_CHARS, "a graph published ids of a step nobody armed (call arm() before each replay)");
        s->failed = 1;
        release_slot(p, s, 0);
        event(p, i, HOW_UNARMED, seen, (long long)(s->max_tokens * s->columns));
        pthread_mutex_unlock(&p->lock);
        return;
    }
    SET_STATE(s, GATHERING);
    int tokens = s->tokens;
    uint64_t step = s->step;
    int64_t deadline = s->deadline_ns;
    if (s->budget_ns > 0 && seen < deadline - s->budget_ns) /* the gather's own deadline: from the ids */
        deadline = seen + s->budget_ns;
    int source = s->source;
    void *ep = s->ep;
    s->timed_out = 0;
    if (tokens == 0) { /* a step of no real token (a DP rank's idle batch): nothing to read, its rows are right */
        release_slot(p, s, 1);
        event(p, i, HOW_ROWS, seen, 0);
        pthread_mutex_unlock(&p->lock);
        return;
    }
    pthread_mutex_unlock(&p->lock);

    size_t n = (size_t)tokens * s->columns, all = n;
    const int64_t *ids = s->ids.buf;
    char *out = s->staging.buf;
    int ok = 0, fatal = 0, resend = 0;
    if (p->has_dead) { /* only the live ids are read, into the first rows; spread to their places after */
        size_t m = 0;
        for (size_t k = 0; k < n; k++)
            if (ids[k] != p->dead_id) {
                s->live[m] = ids[k];
                s->pos[m++] = (int64_t)k;
            }
        ids = s->live;
        n = m;
    }
    if (n == 0) { /* every id dead (padding): zero rows, and they are the step's rows, whatever the source */
        ok = 1;
    } else if (source == SRC_HOST) { /* Python's to read and release (or the policy here at the deadline) */
        pthread_mutex_lock(&p->lock);
        if (s->step == step && s->state == GATHERING)
            hand_off(p, s, seen, deadline);
        else
            pthread_cond_broadcast(&p->changed); /* reset meanwhile */
        pthread_mutex_unlock(&p->lock);
        return;
    } else if (source == SRC_SHM) {
        ptrdiff_t bad = first_bad(ids, (ptrdiff_t)n, s->table_rows);
        if (bad >= 0)
            snprintf(s->error, ERROR_CHARS, "row id %lld at %td is outside the table's %llu rows", (long long)ids[bad],
                     bad, (unsigned long long)s->table_rows);
        else {
            copy_rows(s->table.buf, s->table_rows, s->row_bytes, ids, (ptrdiff_t)n, out);
            ok = 1;
        }
    } else if (source == SRC_TCP) {
        int r = n == 0 ? 0 : gather_tcp(s, ids, n, out, deadline, &fatal);
        ok = r == 0;
        resend = r == GATHER_RESEND;
    } else if (source == SRC_RDMA) {
        ptrdiff_t bad = first_bad(ids, (ptrdiff_t)n, s->table_rows);
        if (bad >= 0)
            snprintf(s->error, ERROR_CHARS, "row id %lld at %td is outside the table's %llu rows", (long long)ids[bad],
                     bad, (unsigned long long)s->table_rows);
        else if (n) {
            int r = verbs_api->gather(ep, ids, n, out, deadline, &s->timed_out, s->error, ERROR_CHARS);
            ok = r == 0;
            fatal = r == -1; /* the endpoint broke (its QP in the error state): never read again */
            resend = fatal && !s->timed_out; /* an error, not silence (a restarted node): nothing was written */
        } else
            ok = 1;
    } else {
        snprintf(s->error, ERROR_CHARS, "no connection to the layer's node (it reconnects in the background)");
    }
    if (ok && p->has_dead)
        spread(s, n, all);
    pthread_mutex_lock(&p->lock);
    if (fatal && (s->source == SRC_TCP || s->source == SRC_RDMA))
        break_source(s, resend); /* Python connects anew (set_tcp, set_rdma), off the launch path */
    if (s->step == step && s->state == GATHERING) {
        if (resend && deadline > now_ns()) {
            hand_off(p, s, seen, deadline); /* this step's rows through the client's transport */
        } else {
            if (!ok) {
                fill_policy(s, tokens);
                s->failed = 1;
            }
            release_slot(p, s, ok);
            event(p, i, ok ? HOW_ROWS : s->timed_out ? HOW_LATE : HOW_POLICY, seen, ok ? 0 : (long long)all);
        }
    } else {
        pthread_cond_broadcast(&p->changed); /* reset meanwhile: the gather's rows are nobody's */
    }
    pthread_mutex_unlock(&p->lock);
}

/* (lock held) waits on p->changed for at most ns (arm() and close() signal it) */
static void nap_on(Poller *p, int64_t ns)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t at = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec + ns;
    ts.tv_sec = at / 1000000000;
    ts.tv_nsec = at % 1000000000;
    pthread_cond_timedwait(&p->changed, &p->lock, &ts);
}

/* (lock held) whether a slot is armed now */
static int any_armed(Poller *p)
{
    for (int i = 0; i < p->nslots; i++)
        if (STATE(&p->slots[i]) == ARMED)
            return 1;
    return 0;
}

static void *run(void *arg)
{
    Poller *p = arg;
    int64_t last_armed = now_ns();
    prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0); /* this thread's naps end within a microsecond of their time */
    prctl(PR_SET_NAME, "graph-poller", 0, 0, 0); /* 15 bytes at most */
    if (p->want_cpu >= 0 && p->want_cpu < CPU_SETSIZE) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(p->want_cpu, &one);
        if (pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0)
            __atomic_store_n(&p->cpu, p->want_cpu, __ATOMIC_RELEASE);
    }
    if (p->want_rt) {
        struct sched_param sp = {.sched_priority = 1};
        __atomic_store_n(&p->rt, pthread_setschedparam(pthread_self(), SCHED_FIFO, &sp) == 0, __ATOMIC_RELEASE);
    }
    pthread_mutex_lock(&p->lock);
    pthread_cond_broadcast(&p->changed); /* Poller() waits for the priority and the CPU to be known */
    p->started = 2;
    pthread_mutex_unlock(&p->lock);
    int64_t hot = __atomic_load_n(&p->rt, __ATOMIC_ACQUIRE) ? 0 : HOT_NS;
    while (!__atomic_load_n(&p->closed, __ATOMIC_ACQUIRE)) {
        int armed = 0, any = 0;
        int64_t t = now_ns();
        for (int i = 0; i < p->nslots; i++) {
            Slot *s = &p->slots[i];
            int state = STATE(s);
            if (state == GATHERING && __atomic_load_n(&s->handoff, __ATOMIC_ACQUIRE) == HANDOFF_PENDING) {
                armed = 1; /* Python has not taken it yet: the policy at its deadline, as for any gather */
                if (t < s->handoff_deadline)
                    continue;
                pthread_mutex_lock(&p->lock);
                if (STATE(s) == GATHERING && s->handoff == HANDOFF_PENDING && t >= s->handoff_deadline) {
                    __atomic_store_n(&s->handoff, HANDOFF_NONE, __ATOMIC_RELEASE);
                    snprintf(s->error, ERROR_CHARS, "rows not in place by the deadline (watchdog): the client's "
                                                    "transport did not take the step in time");
                    fill_policy(s, s->tokens);
                    s->failed = 1;
                    s->timed_out = 1;
                    release_slot(p, s, 0);
                    event(p, i, HOW_LATE, s->handoff_seen, (long long)((size_t)s->tokens * s->columns));
                }
                pthread_mutex_unlock(&p->lock);
                continue;
            }
            if (state != ARMED)
                continue;
            armed = 1;
            if (t < s->deadline_ns)
                continue;
            pthread_mutex_lock(&p->lock);
            if (STATE(s) == ARMED && t >= s->deadline_ns) { /* the watchdog: released before its ids came */
                snprintf(s->error, ERROR_CHARS, "the graph's ids did not come by the deadline (watchdog)");
                fill_policy(s, s->tokens);
                s->failed = 1;
                s->owe = 1;
                release_slot(p, s, 0);
                event(p, i, HOW_WATCHDOG, 0, (long long)((size_t)s->tokens * s->columns));
            }
            pthread_mutex_unlock(&p->lock);
        }
        for (int i = 0; i < p->nslots; i++) {
            if (load(p, p->slots[i].ids_flag) == 1) {
                serve_ids(p, i);
                any = 1;
            }
        }
        if (armed)
            last_armed = t;
        if (any)
            continue;
        if (armed || t - last_armed < hot) {
            /* spinning on between steps keeps this thread on its CPU (a wake-up would put it beside
             * arm()'s caller, behind it, until the next scheduler tick) */
            cpu_relax();
            continue;
        }
        pthread_mutex_lock(&p->lock);
        if (!p->closed && !any_armed(p)) /* woken at once by arm() */
            nap_on(p, t - last_armed < IDLE_AFTER_NS ? SLEEP_NS : IDLE_SLEEP_NS);
        pthread_mutex_unlock(&p->lock);
    }
    return NULL;
}

/* ------------------------------------------------------------------ Python */
static int check_slot(Poller *p, PyObject *arg, int *slot)
{
    int i = PyLong_AsLong(arg);
    if (PyErr_Occurred())
        return -1;
    if (i < 0 || i >= p->nslots) {
        PyErr_SetString(PyExc_IndexError, "no such slot");
        return -1;
    }
    *slot = i;
    return 0;
}

/* (lock held) waits, without the GIL... the caller released it, until the slot is not gathering */
static void wait_not_gathering(Poller *p, Slot *s)
{
    while (s->state == GATHERING)
        pthread_cond_wait(&p->changed, &p->lock);
}

/* (lock held) the slot's table mapping, handed to the caller to release once the lock is dropped */
static int take_table(Slot *s, Py_buffer *old)
{
    int had = s->have_table;
    if (had)
        *old = s->table;
    s->have_table = 0;
    return had;
}

/* (lock held) the slot's rdma endpoint, handed to the caller to let go of once it holds the GIL */
static PyObject *take_endpoint(Slot *s)
{
    PyObject *o = s->endpoint;
    s->endpoint = NULL;
    s->ep = NULL;
    return o;
}

static void drop_source(Slot *s)
{
    if (s->source == SRC_TCP && s->fd >= 0)
        close(s->fd);
    s->fd = -1;
    s->source = SRC_NONE;
}

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
    if (pthread_create(&p->thread, NULL, run, p) != 0) {
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

/* What a slot reads its rows from next: SRC_SHM (table, rows), SRC_TCP (fd, owned, table_index, max_rows),
 * SRC_RDMA (endpoint, a reference owned, ep, rows) or SRC_NONE */
typedef struct {
    int source, fd;
    Py_buffer table;
    uint64_t rows, table_index, max_rows;
    PyObject *endpoint;
    void *ep;
} Source;

/* Points slot i at ``next`` once it is not gathering (the GIL released meanwhile); the mapping it read
 * before is let go once the lock is dropped. Returns None. */
static PyObject *swap_source(Poller *p, int i, Source *next)
{
    Slot *s = &p->slots[i];
    Py_buffer old = {0};
    PyObject *old_endpoint = NULL;
    int had = 0, closed;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->lock);
    wait_not_gathering(p, s);
    closed = p->closed;
    if (closed) { /* stop() let go of every source: this one is let go of below, never kept */
        pthread_mutex_unlock(&p->lock);
        goto out;
    }
    drop_source(s);
    had = take_table(s, &old);
    old_endpoint = take_endpoint(s);
    if (next->source == SRC_SHM) {
        s->table = next->table;
        s->have_table = 1;
        s->table_rows = next->rows;
    } else if (next->source == SRC_TCP) {
        s->fd = next->fd;
        s->table_index = next->table_index;
        s->max_rows = next->max_rows;
    } else if (next->source == SRC_RDMA) {
        s->endpoint = next->endpoint;
        s->ep = next->ep;
        s->table_rows = next->rows;
    }
    s->source = next->source;
    s->broken[0] = 0;
    pthread_mutex_unlock(&p->lock);
out:
    Py_END_ALLOW_THREADS
    if (had)
        PyBuffer_Release(&old);
    Py_XDECREF(old_endpoint);
    if (closed) {
        if (next->source == SRC_TCP && next->fd >= 0)
            close(next->fd);
        if (next->source == SRC_SHM)
            PyBuffer_Release(&next->table);
        Py_XDECREF(next->endpoint);
        PyErr_SetString(PyExc_RuntimeError, "the poller is closed: its sources are let go");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Poller_set_shm(Poller *p, PyObject *args)
{
    PyObject *slot_o, *table;
    unsigned long long rows;
    int i;
    Source next = {.source = SRC_SHM, .fd = -1};
    if (!PyArg_ParseTuple(args, "OOK", &slot_o, &table, &rows) || check_slot(p, slot_o, &i) < 0)
        return NULL;
    if (PyObject_GetBuffer(table, &next.table, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    uint64_t need;
    if (!rows || __builtin_mul_overflow(rows, (uint64_t)p->slots[i].row_bytes, &need) ||
        (uint64_t)next.table.len < need) {
        PyBuffer_Release(&next.table);
        PyErr_SetString(PyExc_ValueError, "the table is smaller than rows x row_bytes");
        return NULL;
    }
    next.rows = rows;
    return swap_source(p, i, &next);
}

static PyObject *Poller_set_tcp(Poller *p, PyObject *args)
{
    PyObject *slot_o;
    int fd, i;
    unsigned long long table_index, max_rows;
    if (!PyArg_ParseTuple(args, "OiKK", &slot_o, &fd, &table_index, &max_rows) || check_slot(p, slot_o, &i) < 0)
        return NULL;
    Source next = {.source = SRC_TCP, .table_index = table_index, .max_rows = max_rows};
    next.fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (next.fd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    int fl = fcntl(next.fd, F_GETFL);
    if (fl < 0 || fcntl(next.fd, F_SETFL, fl | O_NONBLOCK) < 0) { /* sends and reads never block past a deadline */
        close(next.fd);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return swap_source(p, i, &next);
}

static PyObject *Poller_set_rdma(Poller *p, PyObject *args)
{
    PyObject *slot_o, *endpoint;
    int i;
    if (!PyArg_ParseTuple(args, "OO", &slot_o, &endpoint) || check_slot(p, slot_o, &i) < 0)
        return NULL;
    if (!verbs_api) {
        const GraphVerbsAPI *api = PyCapsule_Import(GRAPHVERBS_CAPSULE, 0);
        if (!api)
            return NULL;
        if (api->version != GRAPHVERBS_API_VERSION) {
            PyErr_Format(PyExc_ImportError, "tableclient.graph.poller._verbs speaks version %d, this poller %d: rebuild both",
                         api->version, GRAPHVERBS_API_VERSION);
            return NULL;
        }
        verbs_api = api;
    }
    void *ep = verbs_api->endpoint(endpoint);
    if (!ep)
        return NULL;
    Slot *s = &p->slots[i];
    uint64_t max_rows, rows;
    size_t row_bytes;
    verbs_api->shape(ep, &max_rows, &row_bytes, &rows);
    if (row_bytes != s->row_bytes || max_rows < (uint64_t)(s->max_tokens * s->columns)) { /* checked at init */
        PyErr_Format(PyExc_ValueError, "the endpoint reads %llu rows of %zu B, the slot needs %zu of %zu B",
                     (unsigned long long)max_rows, row_bytes, s->max_tokens * s->columns, s->row_bytes);
        return NULL;
    }
    Py_INCREF(endpoint);
    Source next = {.source = SRC_RDMA, .fd = -1, .endpoint = endpoint, .ep = ep, .rows = rows};
    return swap_source(p, i, &next);
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

/* a source that holds nothing: SRC_HOST (Python reads the slot's steps) or SRC_NONE (the policy) */
static PyObject *set_bare(Poller *p, PyObject *slot_o, int source)
{
    int i;
    Source next = {.source = source, .fd = -1};
    if (check_slot(p, slot_o, &i) < 0)
        return NULL;
    return swap_source(p, i, &next);
}

static PyObject *Poller_set_host(Poller *p, PyObject *slot_o) { return set_bare(p, slot_o, SRC_HOST); }

static PyObject *Poller_set_none(Poller *p, PyObject *slot_o) { return set_bare(p, slot_o, SRC_NONE); }

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
        closed = peer_closed(s->fd);
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
