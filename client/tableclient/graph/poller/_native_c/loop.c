/* client/tableclient/graph/poller/_native_c/loop.c: the native thread of tableclient.graph.poller._native, one per
 * GraphStep -- its start (name, timer slack, CPU, priority), the watchdog (a step whose ids or whose handoff
 * did not come by its deadline), a step's ids served from the slot's source (serve_ids: a mapped table's rows
 * copied, tcp.c's gather, rdma through _verbs, or handed to Python), the dead ids' rows spread, and the naps
 * between steps.
 *
 * The thread takes no GIL, and no lock while it spins: it reads the slots' states and flags atomically
 * and locks only to change a state (a Python call waiting for the lock never queues behind a spinner).
 * It spins (the CPU's pause hint) while a slot is armed and, at normal priority, for HOT_NS after a step
 * (staying on its CPU between decode steps); otherwise it waits on a condition arm() signals for at most
 * SLEEP_NS (IDLE_SLEEP_NS once idle for IDLE_AFTER_NS) between looks otherwise, so a replay nobody armed is
 * still released with zeros within that. It alone writes the staging, and it releases a step with a release
 * store after the last byte is written, so no byte lands after a release (the cancel barrier) and the
 * watchdog (the same loop) never races a gather: a gather past its deadline stops at the deadline (the
 * socket is polled against it) and the policy is applied.
 * A connection that broke mid-response is never read again (the slot gets the policy until set_tcp).
 * Over rdma the gather (verbs.c) polls its completions against the same deadline; at it, or on any
 * error, it moves its QP to the error state and drains the flush (bounded) before it returns and the step
 * is released, and its READs land in the endpoint's own registered bounce buffer, copied into the staging
 * by this thread after they all completed: no READ answered late can reach the staging. The endpoint is
 * then broken for good (broken() says why, set_rdma connects a new one), as a tcp connection is.
 */
#include "poller.h"

#define SLEEP_NS 20000       /* between looks for a replay nobody armed, right after a step */
#define IDLE_SLEEP_NS 1000000 /* the same once no step was armed for IDLE_AFTER_NS */
#define IDLE_AFTER_NS 50000000
#define HOT_NS 20000000 /* spin on for this long after the last armed step (a decode step's gap) */

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

/* (lock held) the slot's step goes to Python (take_handoff): its rows read by the client's own transport */
static void hand_off(Poller *p, Slot *s, int64_t seen, int64_t deadline)
{
    s->handoff_seen = seen;
    s->handoff_deadline = deadline;
    __atomic_store_n(&s->handoff, HANDOFF_PENDING, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&p->changed);
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
        int r = n == 0 ? 0 : poller_gather_tcp(s, ids, n, out, deadline, &fatal);
        ok = r == 0;
        resend = r == GATHER_RESEND;
    } else if (source == SRC_RDMA) {
        ptrdiff_t bad = first_bad(ids, (ptrdiff_t)n, s->table_rows);
        if (bad >= 0)
            snprintf(s->error, ERROR_CHARS, "row id %lld at %td is outside the table's %llu rows", (long long)ids[bad],
                     bad, (unsigned long long)s->table_rows);
        else if (n) {
            int r = poller_verbs_api->gather(ep, ids, n, out, deadline, &s->timed_out, s->error, ERROR_CHARS);
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

/* (lock held) whether a slot is armed now */
static int any_armed(Poller *p)
{
    for (int i = 0; i < p->nslots; i++)
        if (STATE(&p->slots[i]) == ARMED)
            return 1;
    return 0;
}

void *poller_run(void *arg)
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
