/* tableserver/disk/_diskio_c/threads.c: the "threads" engine of tableserver.disk._diskio -- `depth` pthreads,
 * each taking the next run in turn and reading it with preadv(2) -- and the start and stop of the threads of
 * either engine (the io_uring engine runs one, uring.c's driver). */
#include "engine.h"

#define THREAD_STACK (256 << 10)

/* -- the "threads" engine ---------------------------------------------------------------------------- */

static int thread_run(struct core *c, const struct batch *b, struct run *u, int64_t *detail, int64_t *bytes,
                      int64_t *reads)
{
    for (;;) {
        int64_t res;
        int code = diskio_fault_for(c, u);
        if (code < 0) {
            diskio_wait_hold(c);
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
        int s = diskio_settle(u, res, &st, detail);
        if (s == 0)
            return ST_OK;
        if (s < 0)
            return st;
        if (is_cut(c, b))
            return ST_DROPPED;
    }
}

/* One of the "threads" engine's `depth` threads: reads the next run it may start, one at a time. */
void *diskio_worker(void *arg)
{
    struct core *c = arg;
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        unsigned s;
        size_t j;
        if (c->busy >= c->limit || !diskio_claim(c, &s, &j)) {
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
        diskio_record(c, s, j, st, detail, bytes, reads);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* -- the threads of either engine -------------------------------------------------------------------- */

/* Stops the threads: joined when nothing is in flight, else detached (and the core leaked: a stalled read
 * may still write into the pool, and its thread touches the core when it returns). */
void diskio_threads_stop(struct core *c, int join)
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

/* Starts n threads running fn(c), every signal blocked in them: 0, or the errno (none left running). */
int diskio_threads_start(struct core *c, int n, void *(*fn)(void *))
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
        diskio_threads_stop(c, 1);
    return e;
}
