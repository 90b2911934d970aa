/* tableclient.graph._flags: waiting for a host-visible flag without the GIL (see client/tableclient/graph/step.py).
 *
 * wait_u32(flags, index, value, timeout_s) -> bool
 *   flags: a writable C-contiguous buffer of native uint32 (pinned host memory a GPU stream writes with
 *          cuStreamWriteValue32, or any memory another thread writes)
 *   Returns True as soon as flags[index] == value, False once timeout_s seconds have passed first.
 *   The GIL is released for the whole wait: a thread waiting here delays no Python thread. It spins
 *   (with the CPU's pause hint) for SPIN_NS, then sleeps SLEEP_NS between reads, so a flag set within
 *   the spin is seen within a few hundred nanoseconds and a long wait costs a core nothing. Returning
 *   to Python takes the GIL again: behind a thread that holds it, up to one switch interval.
 *
 * Why native: a Python poller needs the GIL for every read of the flag; this one needs it once, to
 * act on the flag it saw.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>

#include "spin.h"

#define SPIN_NS 50000
#define SLEEP_NS 20000


static PyObject *wait_u32(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "wait_u32(flags, index, value, timeout_s) takes 4 arguments");
        return NULL;
    }
    Py_ssize_t index = PyLong_AsSsize_t(args[1]);
    unsigned long value = PyLong_AsUnsignedLong(args[2]);
    double timeout = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    PyObject *result = NULL;
    const char *f = b.format;
    if (f != NULL && (*f == '@' || *f == '=' || *f == '<'))
        f++;
    if (b.itemsize != 4 || f == NULL || (f[0] != 'I' && f[0] != 'L') || f[1] != '\0') {
        PyErr_SetString(PyExc_TypeError, "flags must be a buffer of native uint32");
        goto done;
    }
    if ((uintptr_t)b.buf & 3) { /* an atomic load of a misaligned word may tear: a value nobody wrote */
        PyErr_SetString(PyExc_TypeError, "flags must be 4-byte aligned uint32 (a view at an odd offset?)");
        goto done;
    }
    if (index < 0 || index >= b.len / 4 || value > UINT32_MAX || !(timeout >= 0)) {
        PyErr_SetString(PyExc_ValueError, "index outside the flags, value not a uint32, or a negative timeout");
        goto done;
    }
    volatile uint32_t *flag = (volatile uint32_t *)b.buf + index;
    int hit = 0;
    Py_BEGIN_ALLOW_THREADS
    if (timeout > 1e9)
        timeout = 1e9; /* ~31 years: past it the int64 nanoseconds would overflow */
    int64_t start = now_ns(), end = start + (int64_t)(timeout * 1e9);
    struct timespec nap = {0, SLEEP_NS};
    for (;;) {
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == (uint32_t)value) {
            hit = 1;
            break;
        }
        int64_t t = now_ns();
        if (t >= end)
            break;
        if (t - start < SPIN_NS)
            cpu_relax();
        else
            nanosleep(&nap, NULL);
    }
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(hit);
done:
    PyBuffer_Release(&b);
    return result;
}

static PyMethodDef methods[] = {
    {"wait_u32", (PyCFunction)(void (*)(void))wait_u32, METH_FASTCALL,
     "wait_u32(flags, index, value, timeout_s) -> bool: whether flags[index] became value within timeout_s "
     "(waited for without the GIL)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tableclient.graph._flags",
                                    "Waiting for host-visible flags without the GIL (see client/tableclient/graph/step.py).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__flags(void) { return PyModule_Create(&module); }
