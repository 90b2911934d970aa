/* tableserver/disk/_diskio_c/uring.c: the "io_uring" engine of tableserver.disk._diskio -- the ring (set up,
 * mapped, the page pool registered), its SQEs prepared and completions reaped, and the one thread that keeps
 * `depth` reads in flight over the queued batches -- with the few definitions of <linux/io_uring.h> it uses,
 * spelled out where the header is missing or older. */
#include "engine.h"

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

#define TICK_NS 10000000 /* the io_uring thread looks for new batches and cuts at least this often */
/* The io_uring thread submits the reads it starts in slices of depth / SUBMIT_SLICES SQEs an io_uring_enter
 * (at least 1). A whole queue's worth in one call reaches a virtio disk as one burst, which it completes as
 * one burst (one notification for the lot): the queue then empties before the next burst goes out, and
 * the reads in flight average far below the depth. Slices keep the completions spread out, the queue full,
 * for a syscall every few reads (fio's io_uring engine makes one for every read). */
#define SUBMIT_SLICES 16
/* an SQE's user_data: tag (2 bits) | queue slot (2 bits) | run index (60 bits) */
#define TAG_HOLD (1ULL << 62)
#define TAG_FAIL (2ULL << 62)
#define TAG_MASK (3ULL << 62)
#define SLOT_SHIFT 60
#define IDX_MASK ((1ULL << SLOT_SHIFT) - 1)

/* -- io_uring ---------------------------------------------------------------------------------------- */

void diskio_ring_free(struct ring *R)
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
int diskio_ring_init(struct ring *R, unsigned entries)
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
    diskio_ring_free(R);
    return -e;
}
}

/* Registers buf as the ring's fixed buffer 0 (IORING_OP_READ_FIXED): 0, or the errno */
int diskio_ring_register(struct ring *R, void *buf, size_t len)
{
    struct iovec iov = {buf, len};
    long ret = syscall(__NR_io_uring_register, R->fd, IORING_REGISTER_BUFFERS, &iov, 1);
    return ret == 0 ? 0 : errno;
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
    int code = diskio_fault_for(c, u);
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
        int s = diskio_settle(u, res, &v->st, &v->detail);
        if (s > 0)
            v->again = 1;
        else if (s == 0)
            v->st = ST_OK;
    }
    __atomic_store_n(R->cq_head, head, __ATOMIC_RELEASE);
    return k;
}

/* The io_uring engine's thread: keeps `depth` reads in flight over the queued batches, oldest first. */
void *diskio_driver(void *arg)
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
                diskio_record(c, p.slot, p.j, ST_DROPPED, 0, 0, 0);
            else
                c->retry[keep++] = p;
        }
        nretry = keep;
        unsigned lim = (unsigned)c->limit < depth ? (unsigned)c->limit : depth; /* lowered: the reads drain to it */
        while (inflight + nfill < lim && nretry)
            c->fill[nfill++] = c->retry[--nretry];
        unsigned s;
        size_t j;
        while (inflight + nfill < lim && diskio_claim(c, &s, &j)) {
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
                diskio_record(c, v->slot, v->j, v->st, v->detail, v->bytes, v->reads);
            else if (c->q[v->slot].seq >= c->cut)
                diskio_record(c, v->slot, v->j, ST_DROPPED, 0, v->bytes, v->reads);
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
