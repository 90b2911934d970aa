/* client/tableclient/graph/poller/_native_c/poller.h: what the files of tableclient.graph.poller._native share --
 * the includes, the constants, the states, sources and release kinds of a slot, the structs (Slot, Event,
 * Poller), the small helpers on a slot's flags and state that the thread and the Python calls both use, and
 * the functions one file calls in another (prefixed poller_). The Python interface (Poller, stand_in) is
 * documented at the top of module.c; the thread, and why it is built as it is, at the top of loop.c.
 *
 *   module.c   the Python type Poller (init and stop, arm and the waits, the handoffs' Python side, the events,
 *              the getters), stand_in and the module's init
 *   source.c   what a slot reads its rows from, set from Python: set_shm, set_tcp, set_rdma (the _verbs
 *              capsule, taken at the first), set_host, set_none, swapped in once the slot is not gathering
 *   loop.c     the native thread: the watchdog, a step's ids served from the slot's source (a mapped table's
 *              rows copied, tcp, rdma through _verbs, or handed to Python), the naps between steps
 *   tcp.c      a gather over the tcp wire protocol, against the step's deadline
 *   wire.h     the wire's constants (tableserver/common/wire.py's, checked by tests/unit/test_wire_header.py)
 *   verbs.h    what tableclient.graph.poller._verbs (the rdma source, a module of its own) hands this one
 */
#ifndef TABLECLIENT_POLLER_H
#define TABLECLIENT_POLLER_H

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
#include "wire.h"
#include "rowcopy.h"
#include "spin.h"

#define MAX_SLOTS 64
#define MAX_EVENTS 256
#define ERROR_CHARS 256

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

/* -- a slot's flags and state: the thread (loop.c) and the Python calls (module.c, source.c) both use these -- */

/* the state a slot is in, read by the thread without the lock (written under it, with a release store
 * after everything the state covers: tokens, deadline) */
#define STATE(s) __atomic_load_n(&(s)->state, __ATOMIC_ACQUIRE)
#define SET_STATE(s, v) __atomic_store_n(&(s)->state, (v), __ATOMIC_RELEASE)

static inline uint32_t load(Poller *p, uint32_t i) { return __atomic_load_n(&p->flags[i], __ATOMIC_ACQUIRE); }
static inline void store(Poller *p, uint32_t i, uint32_t v) { __atomic_store_n(&p->flags[i], v, __ATOMIC_RELEASE); }

static inline void event(Poller *p, int slot, int how, int64_t seen, long long zeroed)
{
    if (p->nevents < MAX_EVENTS)
        p->events[p->nevents++] = (Event){slot, how, seen ? (now_ns() - seen) * 1e-9 : 0.0, zeroed};
}

/* (lock held) the slot's staging rows of this step hold what the policy serves: zeros */
static inline void fill_policy(Slot *s, int tokens)
{
    size_t n = (tokens > 0 ? (size_t)tokens : s->max_tokens) * s->columns * s->row_bytes; /* <= the staging: init */
    memset(s->staging.buf, 0, n);
}

/* (lock held) the step's rows are in the staging: the graph may copy them */
static inline void release_slot(Poller *p, Slot *s, int ok)
{
    if (s->ok_flag >= 0)
        store(p, (uint32_t)s->ok_flag, ok ? 1 : 0);
    s->released_ns = now_ns();
    SET_STATE(s, RELEASED);
    store(p, s->rows_flag, 1);
    pthread_cond_broadcast(&p->changed);
}

/* (lock held) waits, without the GIL... the caller released it, until the slot is not gathering */
static inline void wait_not_gathering(Poller *p, Slot *s)
{
    while (s->state == GATHERING)
        pthread_cond_wait(&p->changed, &p->lock);
}

/* (lock held) waits on p->changed for at most ns (arm() and close() signal it) */
static inline void nap_on(Poller *p, int64_t ns)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t at = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec + ns;
    ts.tv_sec = at / 1000000000;
    ts.tv_nsec = at % 1000000000;
    pthread_cond_timedwait(&p->changed, &p->lock, &ts);
}

/* -- the Python calls' slot argument, and a slot's source (module.c, source.c; break_source: loop.c too) -- */

static inline int check_slot(Poller *p, PyObject *arg, int *slot)
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

/* (lock held) the slot's table mapping, handed to the caller to release once the lock is dropped */
static inline int take_table(Slot *s, Py_buffer *old)
{
    int had = s->have_table;
    if (had)
        *old = s->table;
    s->have_table = 0;
    return had;
}

/* (lock held) the slot's rdma endpoint, handed to the caller to let go of once it holds the GIL */
static inline PyObject *take_endpoint(Slot *s)
{
    PyObject *o = s->endpoint;
    s->endpoint = NULL;
    s->ep = NULL;
    return o;
}

static inline void drop_source(Slot *s)
{
    if (s->source == SRC_TCP && s->fd >= 0)
        close(s->fd);
    s->fd = -1;
    s->source = SRC_NONE;
}

/* (lock held) the slot's connection is not read again: why in s->broken; ``host``: its steps go to Python
 * until Python points the slot at a new connection (a connection the server closed: the node answers, and the
 * client's transport reconnects), else the policy (a node that did not answer, or broke the protocol) */
static inline void break_source(Slot *s, int host)
{
    snprintf(s->broken, ERROR_CHARS, "%s", s->error);
    if (s->source == SRC_TCP && s->fd >= 0)
        close(s->fd);
    s->fd = -1;
    s->source = host ? SRC_HOST : SRC_NONE; /* the endpoint is let go by Python, with the GIL (set_* or close) */
    s->ep = NULL;
}

/* The functions below are the poller's own: hidden, so that the module exports PyInit__native alone and calls
 * between its files go straight to them (no PLT) */
#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

/* -- loop.c ------------------------------------------------------------------------------------------ */

void *poller_run(void *arg); /* the thread (pthread_create's start routine, its Poller the argument) */

/* -- tcp.c ------------------------------------------------------------------------------------------- */

int poller_peer_closed(int fd);
int poller_gather_tcp(Slot *s, const int64_t *ids, size_t n, char *out, int64_t deadline, int *fatal);

/* -- source.c ---------------------------------------------------------------------------------------- */

extern const GraphVerbsAPI *poller_verbs_api; /* tableclient.graph.poller._verbs' functions, from the first set_rdma */
PyObject *Poller_set_shm(Poller *p, PyObject *args);
PyObject *Poller_set_tcp(Poller *p, PyObject *args);
PyObject *Poller_set_rdma(Poller *p, PyObject *args);
PyObject *Poller_set_host(Poller *p, PyObject *slot_o);
PyObject *Poller_set_none(Poller *p, PyObject *slot_o);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif /* TABLECLIENT_POLLER_H */
