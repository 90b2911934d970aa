/* tableclient.graph.poller._verbs: the rdma source of the in_graph poller (client/tableclient/graph/poller/_native_c/): verbs
 * resources of its own per in_graph layer, driven by the poller's native thread without the GIL. Built only
 * where libibverbs' headers are (setup.py), linked to libibverbs; _native neither includes nor links it and
 * takes this module's functions through a capsule (verbs.h) when a layer is first pointed at rdma, so it
 * imports where libibverbs is absent. Where this module is missing, in_graph layers read over rdma keep the
 * Python poller (client/tableclient/graph/poller/native.py says why in the start-up log).
 *
 * Endpoint(device, port, gid_index, max_rows, row_bytes)
 *   opens ``device`` (the name the client's rdma transport uses) on ``port``, a PD, one CQ, one RC QP in INIT,
 *   and a bounce buffer of max_rows x row_bytes registered LOCAL_WRITE only (nothing remote can touch this
 *   process's memory through it); OSError with the errno of the verbs call that failed.
 *   qp_num, psn (random), gid (16 bytes), mtu (enum ibv_mtu), max_rd_atomic: what the control plane offers
 *   the server for it (an OpenSession of its own: tableclient.node.QpSession), as the rdma transport does
 * connect(qp_num, psn, gid, mtu, rd_atomic, table_rows, regions)
 *   RTR and RTS against the server's QP (``rd_atomic``: READs in flight, from the server's answer); regions
 *   [(table_offset, addr, rkey, length)] of the one table it reads, tiling it from offset 0 in order
 * read(ids, out, timeout)       a gather from Python (tests): the rows of int64 ``ids`` into ``out``; OSError
 *                               (ETIMEDOUT past timeout, EIO otherwise) when it fails, which breaks the endpoint
 * broken -> str|None            why the endpoint broke (it is never read again: connect a new one)
 * close()                       frees everything, after a gather in progress ended; idempotent
 *
 * A gather (the capsule's ``gather``, the poller's thread): per id, checked by the caller against the table's
 * rows, the remote address from the regions (a binary search where there are several), one RDMA READ into
 * the id's row of the bounce buffer; posted in chained batches (BATCH_ROWS and BATCH_BYTES at most, half
 * the send queue), each batch's last READ alone signaled, two batches in flight; completions polled by
 * spinning until all are in or the deadline, which is also checked before every post: a software device
 * (rxe, siw) does a post's work in the posting thread, so a batch bounds how far past its deadline a
 * gather can run there (a hardware device takes a post at once). Then the rows are copied from the bounce
 * buffer into the caller's staging.
 *
 * The cancel barrier: at the deadline, or on any error (a failed completion, a failed post), the QP goes to
 * the error state and its flush completions are drained (the last READ posted completing, flushed or not,
 * says every earlier one has: an RC send queue completes in order), for DRAIN_NS at most; the endpoint is
 * then broken for good and the gather fails. The caller's staging is written only by the copy after a
 * successful gather, by the calling thread: READs still in flight, or answered late by a server the QP no
 * longer listens to, can only ever land in the bounce buffer, so no byte lands in the staging after the
 * poller released a step even where a device were to flush late. The copy costs a memcpy of the step's rows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>

#include "bufcheck.h"
#include "verbs.h"
#include "rowcopy.h"
#include "spin.h"

#define DEPTH 1024          /* the send queue at most (two batches in flight, so a batch is DEPTH / 2 at most) */
#define BATCH_ROWS 64       /* READs one post chains at most ... */
#define BATCH_BYTES 65536   /* ... and bytes they read at most (software devices run a post in its caller) */
#define POLL_BATCH 16       /* completions taken per ibv_poll_cq */
#define DRAIN_NS 2000000    /* the barrier's wait for the flush of the READs in flight */
#define RETRY_TIMEOUT 14    /* local ACK timeout, 4.096 us x 2^14 per retry: the client's rdma transport's */
#define RETRY_COUNT 7
#define MIN_RNR_TIMER 12
#define HOP_LIMIT 64
#define ERR_CHARS 256

typedef struct {
    uint64_t start, addr, length; /* table offset, remote address, bytes */
    uint32_t rkey;
} Region;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t use; /* held by a gather and by close(): nothing a gather uses is freed under it */
    int lock_ready, closed, connected, outstanding, depth, batch, max_rd_atomic, mtu, gid_index, nregions;
    uint8_t port;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    struct ibv_mr *mr;
    char *bounce;
    size_t bounce_bytes, row_bytes;
    uint64_t max_rows, table_rows, next_wr, last_wr; /* last_wr: the last READ posted */
    uint32_t psn;
    union ibv_gid gid;
    struct ibv_send_wr *wrs;
    struct ibv_sge *sges;
    Region *regions;
    char device[IBV_SYSFS_NAME_MAX];
    char broken[ERR_CHARS];
} Endpoint;

static PyTypeObject EndpointType;

/* OSError(errno, message) */
static void set_os_error(int err, const char *message)
{
    PyObject *args = Py_BuildValue("(is)", err, message);
    if (args) {
        PyErr_SetObject(PyExc_OSError, args);
        Py_DECREF(args);
    }
}

/* (no GIL) everything the endpoint holds, in reverse order of creation */
static void free_verbs(Endpoint *e)
{
    if (e->qp)
        ibv_destroy_qp(e->qp);
    if (e->cq)
        ibv_destroy_cq(e->cq);
    if (e->mr)
        ibv_dereg_mr(e->mr);
    if (e->bounce)
        munmap(e->bounce, e->bounce_bytes);
    if (e->pd)
        ibv_dealloc_pd(e->pd);
    if (e->ctx)
        ibv_close_device(e->ctx);
    e->qp = NULL;
    e->cq = NULL;
    e->mr = NULL;
    e->bounce = NULL;
    e->pd = NULL;
    e->ctx = NULL;
    free(e->wrs);
    free(e->sges);
    free(e->regions);
    e->wrs = NULL;
    e->sges = NULL;
    e->regions = NULL;
    e->nregions = 0;
}

/* (no GIL) the device, PD, bounce MR, CQ and the QP in INIT; 0 or an errno with ``err`` saying what failed */
static int open_verbs(Endpoint *e, const char *name, char *err)
{
    int n = 0, r;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list) {
        r = errno ? errno : ENODEV;
        snprintf(err, ERR_CHARS, "no RDMA device list (%s)", strerror(r));
        return r;
    }
    struct ibv_device *dev = NULL;
    for (int i = 0; i < n; i++)
        if (!strcmp(ibv_get_device_name(list[i]), name))
            dev = list[i];
    if (dev)
        e->ctx = ibv_open_device(dev);
    r = errno;
    ibv_free_device_list(list);
    if (!dev) {
        snprintf(err, ERR_CHARS, "RDMA device %s not found", name);
        return ENODEV;
    }
    if (!e->ctx) {
        snprintf(err, ERR_CHARS, "cannot open RDMA device %s", name);
        return r ? r : ENODEV;
    }
    struct ibv_device_attr da;
    struct ibv_port_attr pa;
    if ((r = ibv_query_device(e->ctx, &da)) || (r = ibv_query_port(e->ctx, e->port, &pa))) {
        snprintf(err, ERR_CHARS, "cannot query RDMA device %s port %u", name, e->port);
        return r;
    }
    if (pa.state != IBV_PORT_ACTIVE) {
        snprintf(err, ERR_CHARS, "RDMA device %s port %u is not ACTIVE", name, e->port);
        return ENETDOWN;
    }
    if ((r = ibv_query_gid(e->ctx, e->port, e->gid_index, &e->gid))) {
        snprintf(err, ERR_CHARS, "no GID %d on RDMA device %s port %u", e->gid_index, name, e->port);
        return r < 0 ? EINVAL : r;
    }
    e->mtu = pa.active_mtu;
    e->max_rd_atomic = da.max_qp_rd_atom > 0 ? da.max_qp_rd_atom : 1;
    int depth = DEPTH;
    if (da.max_qp_wr < depth)
        depth = da.max_qp_wr;
    if (da.max_cqe - 16 < depth)
        depth = da.max_cqe - 16;
    if (depth < 2) {
        snprintf(err, ERR_CHARS, "RDMA device %s holds too few work requests (%d)", name, da.max_qp_wr);
        return EINVAL;
    }
    size_t batch = BATCH_BYTES / e->row_bytes;
    batch = batch < 1 ? 1 : batch > BATCH_ROWS ? BATCH_ROWS : batch;
    e->batch = (int)(batch < (size_t)depth / 2 ? batch : (size_t)depth / 2);
    e->depth = depth = 2 * e->batch; /* two batches in flight: all the send queue ever holds */
    if (!(e->pd = ibv_alloc_pd(e->ctx))) {
        snprintf(err, ERR_CHARS, "cannot allocate a PD on %s", name);
        return errno ? errno : ENOMEM;
    }
    void *m = mmap(NULL, e->bounce_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (m == MAP_FAILED) {
        snprintf(err, ERR_CHARS, "cannot map a bounce buffer of %zu bytes", e->bounce_bytes);
        return errno;
    }
    e->bounce = m;
    if (!(e->mr = ibv_reg_mr(e->pd, e->bounce, e->bounce_bytes, IBV_ACCESS_LOCAL_WRITE))) {
        snprintf(err, ERR_CHARS, "cannot register a bounce buffer of %zu bytes on %s (the locked-memory limit?)",
                 e->bounce_bytes, name);
        return errno ? errno : ENOMEM;
    }
    /* every READ in flight may complete at once, flushed: the CQ holds the whole send queue */
    if (!(e->cq = ibv_create_cq(e->ctx, depth + 16, NULL, NULL, 0))) {
        snprintf(err, ERR_CHARS, "cannot create a CQ of %d entries on %s", depth + 16, name);
        return errno ? errno : ENOMEM;
    }
    struct ibv_qp_init_attr ia = {0};
    ia.send_cq = e->cq;
    ia.recv_cq = e->cq;
    ia.qp_type = IBV_QPT_RC;
    ia.sq_sig_all = 0; /* only a batch's last READ completes with an entry */
    ia.cap.max_send_wr = (uint32_t)depth;
    ia.cap.max_recv_wr = 1;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    if (!(e->qp = ibv_create_qp(e->pd, &ia))) {
        snprintf(err, ERR_CHARS, "cannot create an RC QP on %s", name);
        return errno ? errno : ENOMEM;
    }
    struct ibv_qp_attr a = {0};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = e->port;
    a.qp_access_flags = 0; /* it only reads: nothing remote reads or writes through it */
    if ((r = ibv_modify_qp(e->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))) {
        snprintf(err, ERR_CHARS, "cannot move QP %u to INIT", e->qp->qp_num);
        return r;
    }
    uint32_t psn = 0;
    if (getrandom(&psn, sizeof psn, 0) != sizeof psn) {
        snprintf(err, ERR_CHARS, "no random PSN");
        return errno ? errno : EIO;
    }
    e->psn = psn & 0xFFFFFF;
    e->wrs = calloc((size_t)e->batch, sizeof *e->wrs);
    e->sges = calloc((size_t)e->batch, sizeof *e->sges);
    if (!e->wrs || !e->sges) {
        snprintf(err, ERR_CHARS, "no memory for %d work requests", e->batch);
        return ENOMEM;
    }
    return 0;
}

static int Endpoint_init(Endpoint *e, PyObject *args, PyObject *kw)
{
    const char *device;
    int port, gid_index;
    unsigned long long max_rows;
    Py_ssize_t row_bytes;
    static char *names[] = {"device", "port", "gid_index", "max_rows", "row_bytes", NULL};
    if (e->lock_ready) {
        PyErr_SetString(PyExc_RuntimeError, "an Endpoint is initialized once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "siiKn", names, &device, &port, &gid_index, &max_rows, &row_bytes))
        return -1;
    if (port < 1 || port > 255 || gid_index < 0 || !max_rows || row_bytes < 1 ||
        max_rows > (unsigned long long)PY_SSIZE_T_MAX / (unsigned long long)row_bytes ||
        strlen(device) >= sizeof e->device) {
        PyErr_SetString(PyExc_ValueError, "port 1-255, gid_index >= 0, max_rows and row_bytes > 0, a device name");
        return -1;
    }
    pthread_mutex_init(&e->use, NULL);
    e->lock_ready = 1;
    snprintf(e->device, sizeof e->device, "%s", device);
    e->port = (uint8_t)port;
    e->gid_index = gid_index;
    e->max_rows = max_rows;
    e->row_bytes = (size_t)row_bytes;
    e->bounce_bytes = (size_t)max_rows * (size_t)row_bytes;
    char err[ERR_CHARS];
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = open_verbs(e, e->device, err);
    if (r)
        free_verbs(e);
    Py_END_ALLOW_THREADS
    if (r) {
        e->closed = 1;
        set_os_error(r, err);
        return -1;
    }
    return 0;
}

/* regions [(table_offset, addr, rkey, length)], tiling the table from 0 in order, into e->regions */
static int parse_regions(Endpoint *e, PyObject *seq)
{
    PyObject *fast = PySequence_Fast(seq, "regions must be a sequence of (table_offset, addr, rkey, length)");
    if (!fast)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Region *out = n > 0 ? calloc((size_t)n, sizeof *out) : NULL;
    uint64_t end = 0, need = e->table_rows * e->row_bytes;
    if (n < 1 || !out) {
        Py_DECREF(fast);
        free(out);
        if (n >= 1)
            PyErr_NoMemory();
        else
            PyErr_SetString(PyExc_ValueError, "the server registered no memory of this table for READs");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long start, addr, length;
        unsigned int rkey;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "KKIK", &start, &addr, &rkey, &length))
            goto fail;
        if (start != end || length < e->row_bytes || start % e->row_bytes) {
            PyErr_Format(PyExc_ValueError, "the table's regions do not tile it on row boundaries (offset %llu)", start);
            goto fail;
        }
        out[i] = (Region){start, addr, length, rkey};
        end = start + length;
    }
    if (end < need) {
        PyErr_Format(PyExc_ValueError, "the table's regions end at %llu of its %llu bytes", (unsigned long long)end,
                     (unsigned long long)need);
        goto fail;
    }
    Py_DECREF(fast);
    e->regions = out;
    e->nregions = (int)n;
    return 0;
fail:
    Py_DECREF(fast);
    free(out);
    return -1;
}

static PyObject *Endpoint_connect(Endpoint *e, PyObject *args)
{
    unsigned int qp_num, psn;
    int mtu, rd_atomic;
    Py_buffer gid;
    unsigned long long table_rows;
    PyObject *regions;
    if (!PyArg_ParseTuple(args, "IIy*iiKO", &qp_num, &psn, &gid, &mtu, &rd_atomic, &table_rows, &regions))
        return NULL;
    int bad = gid.len != 16;
    union ibv_gid dgid;
    if (!bad)
        memcpy(dgid.raw, gid.buf, 16);
    PyBuffer_Release(&gid);
    if (bad || mtu < IBV_MTU_256 || mtu > IBV_MTU_4096 || !table_rows) {
        PyErr_SetString(PyExc_ValueError, "a 16-byte GID, an ibv_mtu (1-5) and a table of rows");
        return NULL;
    }
    if (e->closed || e->connected) {
        PyErr_SetString(PyExc_RuntimeError, e->closed ? "the endpoint is closed" : "the endpoint is connected already");
        return NULL;
    }
    e->table_rows = table_rows;
    if (parse_regions(e, regions) < 0)
        return NULL;
    if (rd_atomic > e->max_rd_atomic)
        rd_atomic = e->max_rd_atomic;
    if (rd_atomic < 1)
        rd_atomic = 1;
    int r;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&e->use);
    struct ibv_qp_attr a = {0};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = (enum ibv_mtu)(mtu < e->mtu ? mtu : e->mtu);
    a.dest_qp_num = qp_num;
    a.rq_psn = psn & 0xFFFFFF;
    a.max_dest_rd_atomic = (uint8_t)rd_atomic;
    a.min_rnr_timer = MIN_RNR_TIMER;
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = dgid;
    a.ah_attr.grh.sgid_index = (uint8_t)e->gid_index;
    a.ah_attr.grh.hop_limit = HOP_LIMIT;
    a.ah_attr.port_num = e->port;
    r = e->closed ? EBADF
                  : ibv_modify_qp(e->qp, &a,
                                  IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                      IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (!r) {
        memset(&a, 0, sizeof a);
        a.qp_state = IBV_QPS_RTS;
        a.sq_psn = e->psn;
        a.timeout = RETRY_TIMEOUT;
        a.retry_cnt = RETRY_COUNT;
        a.rnr_retry = 7;
        a.max_rd_atomic = (uint8_t)rd_atomic;
        r = ibv_modify_qp(e->qp, &a,
                          IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                              IBV_QP_MAX_QP_RD_ATOMIC);
    }
    if (!r)
        e->connected = 1;
    pthread_mutex_unlock(&e->use);
    Py_END_ALLOW_THREADS
    if (r) {
        char msg[ERR_CHARS];
        snprintf(msg, sizeof msg, "cannot connect QP %u on %s to the server's QP %u", e->qp ? e->qp->qp_num : 0,
                 e->device, qp_num);
        set_os_error(r, msg);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* (the use lock held) the remote address and rkey of row ``id``; -1 where no region holds it whole */
static int resolve(const Endpoint *e, int64_t id, uint64_t *addr, uint32_t *rkey)
{
    uint64_t off = (uint64_t)id * e->row_bytes;
    int lo = 0, hi = e->nregions - 1;
    while (lo < hi) { /* the last region starting at or before off */
        int mid = (lo + hi + 1) / 2;
        if (e->regions[mid].start <= off)
            lo = mid;
        else
            hi = mid - 1;
    }
    const Region *r = &e->regions[lo];
    if (off < r->start || off - r->start + e->row_bytes > r->length)
        return -1;
    *addr = r->addr + (off - r->start);
    *rkey = r->rkey;
    return 0;
}

/* (the use lock held) the cancel barrier: the QP to the error state, its flush drained (DRAIN_NS at most);
 * the endpoint broken for good, ``why`` kept */
static void barrier(Endpoint *e, const char *why)
{
    struct ibv_qp_attr a = {0};
    a.qp_state = IBV_QPS_ERR;
    int r = ibv_modify_qp(e->qp, &a, IBV_QP_STATE);
    int drained = !e->outstanding;
    int64_t end = now_ns() + DRAIN_NS;
    while (!drained && !r && now_ns() < end) {
        struct ibv_wc wc[POLL_BATCH];
        int got = ibv_poll_cq(e->cq, POLL_BATCH, wc);
        if (got < 0)
            break;
        for (int i = 0; i < got; i++)
            drained |= wc[i].wr_id == e->last_wr;
        if (!got)
            cpu_relax();
    }
    e->outstanding = !drained;
    snprintf(e->broken, ERR_CHARS, "%s%s", why,
             r ? " (its QP did not go to the error state)" : drained ? "" : " (its READs not flushed in time)");
}

static int gather(void *h, const int64_t *ids, size_t n, char *out, int64_t deadline, int *timed_out, char *err,
                  size_t err_len)
{
    Endpoint *e = h;
    int rc = -1;
    *timed_out = 0;
    pthread_mutex_lock(&e->use);
    if (e->closed || !e->connected) {
        snprintf(err, err_len, "the rdma endpoint is %s", e->closed ? "closed" : "not connected");
        goto out;
    }
    if (e->broken[0]) {
        snprintf(err, err_len, "%s", e->broken);
        goto out;
    }
    rc = -2; /* refused before anything was posted: the endpoint stays whole */
    if (n > e->max_rows) {
        snprintf(err, err_len, "%zu rows in one gather, the endpoint holds %llu", n, (unsigned long long)e->max_rows);
        goto out;
    }
    if (n && now_ns() >= deadline) {
        *timed_out = 1;
        snprintf(err, err_len, "rows not in place by the deadline (watchdog)");
        goto out;
    }
    rc = -1;
    size_t rb = e->row_bytes, batch = (size_t)e->batch, posted = 0, done = 0, ends[2] = {0, 0};
    uint64_t signaled[2] = {0, 0}; /* the signaled READ of each batch in flight, oldest at head */
    int head = 0, inflight = 0;
    while (done < n) {
        while (posted < n && inflight < 2 && now_ns() < deadline) {
            size_t k = n - posted < batch ? n - posted : batch;
            for (size_t j = 0; j < k; j++) {
                size_t row = posted + j;
                struct ibv_send_wr *w = &e->wrs[j];
                struct ibv_sge *g = &e->sges[j];
                uint64_t addr;
                uint32_t rkey;
                if (resolve(e, ids[row], &addr, &rkey) < 0) {
                    snprintf(err, err_len, "row id %lld is outside the server's regions of the table",
                             (long long)ids[row]);
                    goto cancel;
                }
                g->addr = (uintptr_t)(e->bounce + row * rb);
                g->length = (uint32_t)rb;
                g->lkey = e->mr->lkey;
                memset(w, 0, sizeof *w);
                w->wr_id = ++e->next_wr;
                w->sg_list = g;
                w->num_sge = 1;
                w->opcode = IBV_WR_RDMA_READ;
                w->send_flags = j + 1 == k ? IBV_SEND_SIGNALED : 0;
                w->wr.rdma.remote_addr = addr;
                w->wr.rdma.rkey = rkey;
                w->next = j + 1 == k ? NULL : &e->wrs[j + 1];
            }
            struct ibv_send_wr *bad_wr = NULL;
            int r = ibv_post_send(e->qp, e->wrs, &bad_wr);
            if (r) {
                if (bad_wr != e->wrs) { /* those before it were posted: the barrier waits for the last of them */
                    e->outstanding = 1;
                    e->last_wr = bad_wr ? bad_wr->wr_id - 1 : e->wrs[k - 1].wr_id;
                }
                snprintf(err, err_len, "posting %zu RDMA READs failed: %s", k, strerror(r));
                goto cancel;
            }
            e->outstanding = 1;
            e->last_wr = e->wrs[k - 1].wr_id;
            int at = (head + inflight) % 2;
            ends[at] = posted + k;
            signaled[at] = e->last_wr;
            inflight++;
            posted += k;
        }
        struct ibv_wc wc[POLL_BATCH];
        int got = ibv_poll_cq(e->cq, POLL_BATCH, wc), failed = -1;
        if (got < 0) {
            snprintf(err, err_len, "polling the RDMA completion queue failed");
            goto cancel;
        }
        for (int i = 0; i < got; i++) {
            if (wc[i].wr_id == e->last_wr) /* flushed or not: nothing of this QP is in flight any more */
                e->outstanding = 0;
            if (wc[i].status != IBV_WC_SUCCESS) {
                if (failed < 0)
                    failed = i;
                continue;
            }
            if (inflight && wc[i].wr_id == signaled[head]) {
                done = ends[head];
                head ^= 1;
                inflight--;
            }
        }
        if (failed >= 0) {
            snprintf(err, err_len, "an RDMA READ failed: %s (vendor error %u)", ibv_wc_status_str(wc[failed].status),
                     wc[failed].vendor_err);
            goto cancel;
        }
        if (done < n && now_ns() >= deadline) {
            *timed_out = 1;
            snprintf(err, err_len, "rows not in place by the deadline (watchdog)");
            goto cancel;
        }
        if (!got)
            cpu_relax();
    }
    e->outstanding = 0;
    memcpy(out, e->bounce, n * rb);
    rc = 0;
    goto out;
cancel:
    barrier(e, err);
out:
    pthread_mutex_unlock(&e->use);
    return rc;
}

static void *as_endpoint(PyObject *o)
{
    if (!PyObject_TypeCheck(o, &EndpointType)) {
        PyErr_SetString(PyExc_TypeError, "not a tableclient.graph.poller._verbs.Endpoint");
        return NULL;
    }
    Endpoint *e = (Endpoint *)o;
    if (e->closed || !e->connected) {
        PyErr_SetString(PyExc_ValueError, e->closed ? "the endpoint is closed" : "the endpoint is not connected");
        return NULL;
    }
    return e;
}

static void shape(void *h, uint64_t *max_rows, size_t *row_bytes, uint64_t *table_rows)
{
    Endpoint *e = h;
    *max_rows = e->max_rows;
    *row_bytes = e->row_bytes;
    *table_rows = e->table_rows;
}

static const GraphVerbsAPI api = {GRAPHVERBS_API_VERSION, as_endpoint, shape, gather};

static PyObject *Endpoint_read(Endpoint *e, PyObject *args)
{
    PyObject *ids_o, *out_o;
    double timeout;
    if (!PyArg_ParseTuple(args, "OOd", &ids_o, &out_o, &timeout))
        return NULL;
    if (!as_endpoint((PyObject *)e))
        return NULL;
    Py_buffer ids, out;
    if (PyObject_GetBuffer(ids_o, &ids, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(out_o, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    size_t n = (size_t)(ids.len / 8);
    ptrdiff_t bad = is_int64(&ids) ? first_bad(ids.buf, (ptrdiff_t)n, e->table_rows) : 0;
    PyObject *result = NULL;
    if (!is_int64(&ids) || (size_t)out.len < n * e->row_bytes || n > e->max_rows || !(timeout >= 0))
        PyErr_SetString(PyExc_ValueError, "int64 ids, an out of their rows, at most max_rows, timeout >= 0");
    else if (bad >= 0)
        PyErr_Format(PyExc_ValueError, "row id %lld at %zd is outside the table's %llu rows",
                     (long long)((int64_t *)ids.buf)[bad], (Py_ssize_t)bad, (unsigned long long)e->table_rows);
    else {
        char err[ERR_CHARS];
        int r = 0, timed_out = 0;
        Py_BEGIN_ALLOW_THREADS
        if (n)
            r = gather(e, ids.buf, n, out.buf, now_ns() + (int64_t)(timeout * 1e9), &timed_out, err, sizeof err);
        Py_END_ALLOW_THREADS
        if (r)
            set_os_error(timed_out ? ETIMEDOUT : r == -2 ? EINVAL : EIO, err);
        else
            result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    return result;
}

static void close_endpoint(Endpoint *e)
{
    if (!e->lock_ready)
        return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&e->use); /* a gather in progress ends first (by its deadline) */
    e->closed = 1;
    free_verbs(e);
    pthread_mutex_unlock(&e->use);
    Py_END_ALLOW_THREADS
}

static PyObject *Endpoint_close(Endpoint *e, PyObject *unused)
{
    close_endpoint(e);
    Py_RETURN_NONE;
}

static void Endpoint_dealloc(Endpoint *e)
{
    close_endpoint(e);
    if (e->lock_ready)
        pthread_mutex_destroy(&e->use);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static PyObject *Endpoint_get(Endpoint *e, void *which)
{
    if (!e->lock_ready) {
        PyErr_SetString(PyExc_ValueError, "the endpoint is not initialized");
        return NULL;
    }
    switch ((intptr_t)which) {
    case 0:
        return PyLong_FromUnsignedLong(e->qp ? e->qp->qp_num : 0);
    case 1:
        return PyLong_FromUnsignedLong(e->psn);
    case 2:
        return PyBytes_FromStringAndSize((const char *)e->gid.raw, 16);
    case 3:
        return PyLong_FromLong(e->mtu);
    case 4:
        return PyLong_FromLong(e->max_rd_atomic);
    case 5:
        return PyUnicode_FromString(e->device);
    default: {
        char why[ERR_CHARS];
        pthread_mutex_t *m = &e->use;
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(m);
        memcpy(why, e->broken, ERR_CHARS);
        pthread_mutex_unlock(m);
        Py_END_ALLOW_THREADS
        if (!why[0])
            Py_RETURN_NONE;
        return PyUnicode_DecodeUTF8(why, (Py_ssize_t)strnlen(why, ERR_CHARS), "replace");
    }
    }
}

static PyGetSetDef Endpoint_getset[] = {
    {"qp_num", (getter)Endpoint_get, NULL, "its QP's number", (void *)0},
    {"psn", (getter)Endpoint_get, NULL, "its send queue's first PSN (random)", (void *)1},
    {"gid", (getter)Endpoint_get, NULL, "its port's GID at gid_index (16 bytes)", (void *)2},
    {"mtu", (getter)Endpoint_get, NULL, "its port's active MTU (enum ibv_mtu)", (void *)3},
    {"max_rd_atomic", (getter)Endpoint_get, NULL, "READs its device keeps in flight per QP", (void *)4},
    {"device", (getter)Endpoint_get, NULL, "the RDMA device's name", (void *)5},
    {"broken", (getter)Endpoint_get, NULL, "why it broke (never read again), or None", (void *)6},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Endpoint_methods[] = {
    {"connect", (PyCFunction)Endpoint_connect, METH_VARARGS,
     "connect(qp_num, psn, gid, mtu, rd_atomic, table_rows, regions): RTR and RTS against the server's QP"},
    {"read", (PyCFunction)Endpoint_read, METH_VARARGS,
     "read(ids, out, timeout): the rows of ids into out; OSError (the endpoint then broken) when it fails"},
    {"close", (PyCFunction)Endpoint_close, METH_NOARGS, "close(): frees the verbs resources (idempotent)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EndpointType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tableclient.graph.poller._verbs.Endpoint",
    .tp_basicsize = sizeof(Endpoint),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One in_graph layer's verbs resources over rdma: an RC QP reading one table (see the module).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Endpoint_init,
    .tp_dealloc = (destructor)Endpoint_dealloc,
    .tp_methods = Endpoint_methods,
    .tp_getset = Endpoint_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tableclient.graph.poller._verbs",
                                    "The rdma source of the in_graph poller (client/tableclient/graph/poller/_native_c/verbs.c).", -1,
                                    NULL};

PyMODINIT_FUNC PyInit__verbs(void)
{
    if (PyType_Ready(&EndpointType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    PyObject *capsule = PyCapsule_New((void *)&api, GRAPHVERBS_CAPSULE, NULL);
    if (!capsule || PyModule_AddObject(m, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&EndpointType);
    if (PyModule_AddObject(m, "Endpoint", (PyObject *)&EndpointType) < 0) {
        Py_DECREF(&EndpointType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "DEPTH", DEPTH);
    return m;
}
