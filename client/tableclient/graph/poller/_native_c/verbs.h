/* client/tableclient/graph/poller/_native_c/verbs.h: what tableclient.graph.poller._verbs (the rdma source of the in_graph poller, built
 * only where libibverbs' headers are) hands tableclient.graph.poller._native through a capsule, so that _native itself
 * neither includes nor links libibverbs and imports where it is absent. See verbs.c for the design. */
#ifndef TABLECLIENT_GRAPHVERBS_H
#define TABLECLIENT_GRAPHVERBS_H

#include <stddef.h>
#include <stdint.h>

#define GRAPHVERBS_CAPSULE "tableclient.graph.poller._verbs._C_API"
#define GRAPHVERBS_API_VERSION 1

typedef struct {
    int version; /* GRAPHVERBS_API_VERSION */
    /* (GIL held) the endpoint ``o`` is, connected; NULL with an exception set when it is no Endpoint or not
     * connected. The caller keeps a reference to ``o`` for as long as it uses what this returns. */
    void *(*endpoint)(PyObject *o);
    /* rows a gather reads at most, bytes a row, rows the table has (fixed once connected) */
    void (*shape)(void *ep, uint64_t *max_rows, size_t *row_bytes, uint64_t *table_rows);
    /* (no GIL needed) the n rows of ``ids`` (each checked below table_rows by the caller, n <= max_rows) into
     * ``out`` (n x row_bytes) by ``deadline`` (CLOCK_MONOTONIC ns). 0; or, with why in ``err`` and
     * *timed_out set when the deadline passed: -2 when it posted nothing (the deadline passed before it
     * began, more than max_rows) and the endpoint stays whole, -1 when the endpoint is broken (its QP in the
     * error state, its flush completions drained within a bound): every later gather fails. A failed gather
     * writes nothing to ``out``, and no gather writes to it after it returned: the READs land in the
     * endpoint's own registered bounce buffer, copied to ``out`` once all of them completed */
    int (*gather)(void *ep, const int64_t *ids, size_t n, char *out, int64_t deadline, int *timed_out, char *err,
                  size_t err_len);
} GraphVerbsAPI;

#endif /* TABLECLIENT_GRAPHVERBS_H */
