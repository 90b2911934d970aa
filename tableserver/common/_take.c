/* tableserver.common._take: the row gather every path runs, and the id check (see tableserver/common/take.py).
 *
 * check(row_ids, rows) -> -1 when every id is in 0..rows-1, else the flat position of the first that is not
 *
 * take(table, row_ids, out) -> int
 *   table:   a C-contiguous 2-D buffer of bytes, (rows, row_bytes); read-only is fine
 *   row_ids: a C-contiguous buffer of native int64 ids, any shape
 *   out:     a writable C-contiguous uint8 buffer of shape row_ids.shape + (row_bytes,)
 * Checks every id first: one outside 0..rows-1 returns -1 - its flat position and copies nothing.
 * Otherwise copies table[row_ids] into out and returns the number of rows. Buffers that do not fit
 * (dtype, shape, contiguity, overlap) raise TypeError or ValueError: callers then take numpy's path.
 *
 * unique(row_ids, unique_out, inverse_out, mult) -> k
 *   each id once, in first-occurrence order, in unique_out[:k], and inverse_out[i] = the position of row_ids[i]
 *   there: one hashing pass where np.unique sorts (dedup of a batch's repeated ids, client/tableclient/rowids.py).
 *   All three int64; outputs at least as long as the ids. MemoryError when its table (16 bytes a slot,
 *   >= 2 slots an id) cannot be allocated.
 *
 * Why native: numpy's take copies one row per iteration and leaves the next rows' cache misses to the
 * CPU; prefetching PREFETCH_ROWS rows ahead keeps several misses in flight (a random gather is bound
 * by memory latency), and the id check costs a pass in C instead of Python calls. Each id is clamped
 * again at use, so ids changed by another thread mid-copy still never read outside the table.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "bufcheck.h"
#include "rowcopy.h"

#define NOGIL_BYTES (64 << 10)

static int is_uint8(const Py_buffer *b)
{
    const char *f = b->format;
    if (b->itemsize != 1 || f == NULL)
        return 0;
    if (*f == '@' || *f == '=' || *f == '<' || *f == '>' || *f == '!')
        f++;
    return f[0] == 'B' && f[1] == '\0';
}

static int overlap(const Py_buffer *a, const Py_buffer *b)
{
    const char *a0 = a->buf, *b0 = b->buf;
    return a->len && b->len && a0 < b0 + b->len && b0 < a0 + a->len;
}

/* The first n arguments' buffers, each with its flags; on failure those already taken are released. */
static int get_buffers(PyObject *const *args, Py_buffer *bufs, const int *flags, int n)
{
    for (int i = 0; i < n; i++) {
        if (PyObject_GetBuffer(args[i], &bufs[i], flags[i]) < 0) {
            while (i--)
                PyBuffer_Release(&bufs[i]);
            return -1;
        }
    }
    return 0;
}

static void release_buffers(Py_buffer *bufs, int n)
{
    while (n--)
        PyBuffer_Release(&bufs[n]);
}

#define IDS_FLAGS (PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
#define OUT_FLAGS (PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE)

static PyObject *take(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const int flags[3] = {PyBUF_C_CONTIGUOUS, IDS_FLAGS, OUT_FLAGS};
    Py_buffer bufs[3], tb, ib, ob;
    PyObject *result = NULL;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "take(table, row_ids, out) takes 3 arguments");
        return NULL;
    }
    if (get_buffers(args, bufs, flags, 3) < 0)
        return NULL;
    tb = bufs[0], ib = bufs[1], ob = bufs[2];
    if (tb.ndim != 2 || tb.itemsize != 1 || tb.shape[1] <= 0) {
        PyErr_SetString(PyExc_TypeError, "table must be a 2-D buffer of bytes (rows, row_bytes)");
        goto done;
    }
    if (!is_int64(&ib) || ((uintptr_t)ib.buf & 7)) {
        PyErr_SetString(PyExc_TypeError, "row_ids must be aligned native int64");
        goto done;
    }
    if (!is_uint8(&ob) || ob.ndim != ib.ndim + 1 || ob.shape[ib.ndim] != tb.shape[1]) {
        PyErr_SetString(PyExc_ValueError, "out must be uint8 of shape row_ids.shape + (row_bytes,)");
        goto done;
    }
    for (int d = 0; d < ib.ndim; d++) {
        if (ob.shape[d] != ib.shape[d]) {
            PyErr_SetString(PyExc_ValueError, "out must be uint8 of shape row_ids.shape + (row_bytes,)");
            goto done;
        }
    }
    if (overlap(&ob, &ib) || overlap(&ob, &tb)) {
        PyErr_SetString(PyExc_ValueError, "out overlaps row_ids or the table");
        goto done;
    }
    {
        const int64_t *ids = ib.buf;
        Py_ssize_t n = ib.len / 8;
        uint64_t rows = (uint64_t)tb.shape[0];
        size_t row_bytes = (size_t)tb.shape[1];
        Py_ssize_t bad = first_bad(ids, n, rows);
        if (bad >= 0) {
            result = PyLong_FromSsize_t(-1 - bad);
            goto done;
        }
        if ((size_t)n * row_bytes >= NOGIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            copy_rows(tb.buf, rows, row_bytes, ids, n, ob.buf);
            Py_END_ALLOW_THREADS
        } else {
            copy_rows(tb.buf, rows, row_bytes, ids, n, ob.buf);
        }
        result = PyLong_FromSsize_t(n);
    }
done:
    release_buffers(bufs, 3);
    return result;
}

static PyObject *check(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer ib;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "check(row_ids, rows) takes 2 arguments");
        return NULL;
    }
    long long rows = PyLong_AsLongLong(args[1]);
    if (rows == -1 && PyErr_Occurred())
        return NULL;
    if (rows < 0) {
        PyErr_SetString(PyExc_ValueError, "rows must be >= 0");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &ib, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (!is_int64(&ib) || ((uintptr_t)ib.buf & 7)) {
        PyBuffer_Release(&ib);
        PyErr_SetString(PyExc_TypeError, "row_ids must be aligned native int64");
        return NULL;
    }
    Py_ssize_t pos = first_bad(ib.buf, ib.len / 8, (uint64_t)rows);
    PyBuffer_Release(&ib);
    return PyLong_FromSsize_t(pos);
}

/* Each id once: open addressing, linear probing, at least twice as many slots as ids (a power of two), so a
 * probe ends after ~1.5 slots on average. The hash is multiply-shift with the caller's random odd
 * multiplier (universal: no fixed set of ids collides for every process). Returns the unique count. */
struct slot {
    int64_t id;
    int64_t at; /* its position in unique_out, -1 while the slot is empty */
};

static Py_ssize_t unique_ids(const int64_t *ids, Py_ssize_t n, uint64_t mult, struct slot *slots, int bits,
                             int64_t *unique_out, int64_t *inverse_out)
{
    uint64_t mask = ((uint64_t)1 << bits) - 1;
    Py_ssize_t k = 0;
    memset(slots, 0xff, sizeof(struct slot) << bits);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t id = ids[i];
        uint64_t h = ((uint64_t)id * mult) >> (64 - bits);
        for (;;) {
            struct slot *s = &slots[h];
            if (s->at < 0) {
                s->id = id;
                s->at = k;
                unique_out[k] = id;
                inverse_out[i] = k++;
                break;
            }
            if (s->id == id) {
                inverse_out[i] = s->at;
                break;
            }
            h = (h + 1) & mask;
        }
    }
    return k;
}

static PyObject *unique(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const int flags[3] = {IDS_FLAGS, OUT_FLAGS, OUT_FLAGS};
    Py_buffer bufs[3], ib, ub, vb;
    PyObject *result = NULL;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "unique(row_ids, unique_out, inverse_out, mult) takes 4 arguments");
        return NULL;
    }
    unsigned long long mult = PyLong_AsUnsignedLongLongMask(args[3]);
    if (mult == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (get_buffers(args, bufs, flags, 3) < 0)
        return NULL;
    ib = bufs[0], ub = bufs[1], vb = bufs[2];
    if (!is_int64(&ib) || !is_int64(&ub) || !is_int64(&vb) ||
        (((uintptr_t)ib.buf | (uintptr_t)ub.buf | (uintptr_t)vb.buf) & 7)) {
        PyErr_SetString(PyExc_TypeError, "row_ids, unique_out and inverse_out must be aligned native int64");
        goto done;
    }
    if (ub.len < ib.len || vb.len < ib.len) {
        PyErr_SetString(PyExc_ValueError, "unique_out and inverse_out must hold as many ids as row_ids");
        goto done;
    }
    if (overlap(&ib, &ub) || overlap(&ib, &vb) || overlap(&ub, &vb)) {
        PyErr_SetString(PyExc_ValueError, "row_ids, unique_out and inverse_out must not overlap");
        goto done;
    }
    {
        Py_ssize_t n = ib.len / 8, k;
        int bits = 1;
        while (((uint64_t)1 << bits) < 2 * (uint64_t)n)
            bits++;
        /* slots of 16 bytes, 2**bits of them: refuse what size_t cannot count (32-bit) or is absurd */
        if (bits > 40 || (uint64_t)bits + 4 >= 8 * sizeof(size_t)) {
            PyErr_SetString(PyExc_ValueError, "too many row ids for one dedup");
            goto done;
        }
        if (n == 0) {
            result = PyLong_FromSsize_t(0);
            goto done;
        }
        struct slot *slots = PyMem_RawMalloc(sizeof(struct slot) << bits);
        if (slots == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        mult |= 1;
        if (n >= 4096) {
            Py_BEGIN_ALLOW_THREADS
            k = unique_ids(ib.buf, n, mult, slots, bits, ub.buf, vb.buf);
            Py_END_ALLOW_THREADS
        } else {
            k = unique_ids(ib.buf, n, mult, slots, bits, ub.buf, vb.buf);
        }
        PyMem_RawFree(slots);
        result = PyLong_FromSsize_t(k);
    }
done:
    release_buffers(bufs, 3);
    return result;
}

static PyMethodDef methods[] = {
    {"unique", (PyCFunction)(void (*)(void))unique, METH_FASTCALL,
     "unique(row_ids, unique_out, inverse_out, mult) -> k: each id once, in first-occurrence order, in "
     "unique_out[:k]; inverse_out[i] is row_ids[i]'s position there (hashed with the odd multiplier mult)"},
    {"check", (PyCFunction)(void (*)(void))check, METH_FASTCALL,
     "check(row_ids, rows) -> -1 when every id is in 0..rows-1, else the flat position of the first that is not"},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL,
     "take(table, row_ids, out) -> rows copied, or -1 - the position of an id outside the table "
     "(nothing copied)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tableserver.common._take",
                                    "Bounds-checked, prefetching row gather (see tableserver/common/take.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__take(void) { return PyModule_Create(&module); }
