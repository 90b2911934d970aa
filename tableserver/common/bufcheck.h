/* tableserver/common/bufcheck.h: the buffer checks the C extensions share (tableserver/common/_take.c,
 * tableserver/disk/_diskio_c/module.c). Include it after <Python.h>. */
#ifndef TABLESERVER_BUFCHECK_H
#define TABLESERVER_BUFCHECK_H

#ifndef Py_PYTHON_H
#error "include <Python.h> before bufcheck.h"
#endif

/* A buffer of native int64 (its format "q" or "l", native or explicitly in this machine's byte order) */
static inline int is_int64(const Py_buffer *b)
{
    const char *f = b->format;
    if (b->itemsize != 8 || f == NULL)
        return 0;
    if (*f == '@' || *f == '=' || (PY_LITTLE_ENDIAN ? *f == '<' : *f == '>'))
        f++;
    return (f[0] == 'l' || f[0] == 'q') && f[1] == '\0';
}

#endif /* TABLESERVER_BUFCHECK_H */
