/* client/tableclient/graph/poller/_native_c/source.c: what a slot of tableclient.graph.poller._native reads its
 * rows from, set from Python -- set_shm (a mapped table), set_tcp (a data connection, dup'd), set_rdma (an
 * Endpoint of tableclient.graph.poller._verbs, whose functions are taken from its capsule at the first),
 * set_host and set_none (sources that hold nothing) -- each swapped in under the lock once the slot is not
 * gathering (swap_source), the source it replaces let go. */
#include "poller.h"

/* tableclient.graph.poller._verbs' functions (the rdma source), taken at the first set_rdma */
const GraphVerbsAPI *poller_verbs_api;

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

PyObject *Poller_set_shm(Poller *p, PyObject *args)
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

PyObject *Poller_set_tcp(Poller *p, PyObject *args)
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

PyObject *Poller_set_rdma(Poller *p, PyObject *args)
{
    PyObject *slot_o, *endpoint;
    int i;
    if (!PyArg_ParseTuple(args, "OO", &slot_o, &endpoint) || check_slot(p, slot_o, &i) < 0)
        return NULL;
    if (!poller_verbs_api) {
        const GraphVerbsAPI *api = PyCapsule_Import(GRAPHVERBS_CAPSULE, 0);
        if (!api)
            return NULL;
        if (api->version != GRAPHVERBS_API_VERSION) {
            PyErr_Format(PyExc_ImportError, "tableclient.graph.poller._verbs speaks version %d, this poller %d: rebuild both",
                         api->version, GRAPHVERBS_API_VERSION);
            return NULL;
        }
        poller_verbs_api = api;
    }
    void *ep = poller_verbs_api->endpoint(endpoint);
    if (!ep)
        return NULL;
    Slot *s = &p->slots[i];
    uint64_t max_rows, rows;
    size_t row_bytes;
    poller_verbs_api->shape(ep, &max_rows, &row_bytes, &rows);
    if (row_bytes != s->row_bytes || max_rows < (uint64_t)(s->max_tokens * s->columns)) { /* checked at init */
        PyErr_Format(PyExc_ValueError, "the endpoint reads %llu rows of %zu B, the slot needs %zu of %zu B",
                     (unsigned long long)max_rows, row_bytes, s->max_tokens * s->columns, s->row_bytes);
        return NULL;
    }
    Py_INCREF(endpoint);
    Source next = {.source = SRC_RDMA, .fd = -1, .endpoint = endpoint, .ep = ep, .rows = rows};
    return swap_source(p, i, &next);
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

PyObject *Poller_set_host(Poller *p, PyObject *slot_o) { return set_bare(p, slot_o, SRC_HOST); }

PyObject *Poller_set_none(Poller *p, PyObject *slot_o) { return set_bare(p, slot_o, SRC_NONE); }
