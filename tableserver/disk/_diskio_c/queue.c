/* tableserver/disk/_diskio_c/queue.c: the batch queue of tableserver.disk._diskio, under the core's mutex --
 * a run claimed, recorded back, the batches reclaimed, waited for, drained, enqueued -- what one read's result
 * means for its run (settle, both engines), and the fault hook of the tests. */
#include "engine.h"

/* -- the fault hook (tests) -------------------------------------------------------------------------- */

/* 0: no fault on this read; > 0: complete it with that errno; -1: hold it until the fault is cleared */
int diskio_fault_for(struct core *c, const struct run *u)
{
    int code = __atomic_load_n(&c->fault_code, __ATOMIC_ACQUIRE);
    if (!code)
        return 0;
    int64_t at = __atomic_load_n(&c->fault_off, __ATOMIC_RELAXED);
    if (at < u->off + u->got || at >= u->off + u->len)
        return 0;
    return code > 0 ? code : -1;
}

void diskio_wait_hold(struct core *c)
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
int diskio_settle(struct run *u, int64_t res, int *st, int64_t *detail)
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
int diskio_claim(struct core *c, unsigned *slot, size_t *j)
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

int64_t diskio_in_flight(const struct core *c)
{
    int64_t n = 0;
    for (unsigned k = 0; k < c->count; k++) {
        const struct batch *b = &c->q[(c->head + k) % MAX_QUEUED];
        n += (int64_t)(b->issued - b->finished);
    }
    return n;
}

/* One run is back (or given up): its batch's counters, the first failure, the cut after it. */
void diskio_record(struct core *c, unsigned s, size_t j, int st, int64_t detail, int64_t bytes, int64_t reads)
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
int64_t diskio_drain(struct core *c, int64_t deadline)
{
    if (!c->count)
        return 0;
    set_cut(c, 0);
    pthread_cond_broadcast(&c->work);
    if (wait_until(c, reclaim, deadline))
        return 0;
    return diskio_in_flight(c);
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
void diskio_wait_head(struct core *c, int64_t deadline, int64_t out[5])
{
    if (!wait_until(c, head_done, deadline)) {
        set_cut(c, 0);
        pthread_cond_broadcast(&c->work);
        out[0] = c->broken ? ST_ERROR : ST_TIMEOUT;
        out[1] = -1;
        out[2] = c->broken ? c->broken : diskio_in_flight(c);
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
int diskio_enqueue(struct core *c, const int64_t *const a[5], size_t n, int64_t deadline)
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
