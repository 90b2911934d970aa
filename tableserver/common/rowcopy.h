/* tableserver/common/rowcopy.h: the row gather itself, shared by the extensions that copy rows
 * (tableserver/common/_take.c, client/tableclient/graph/poller/_native_c/loop.c): the id check and the prefetching copy.
 * Plain C (no Python): safe to call without the GIL.
 *
 * Why prefetch: a random gather is bound by memory latency; prefetching PREFETCH_ROWS rows ahead keeps
 * several misses in flight. Each id is clamped again at use, so ids changed by another thread mid-copy
 * still never read outside the table. */
#ifndef TABLESERVER_ROWCOPY_H
#define TABLESERVER_ROWCOPY_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PREFETCH_ROWS 16
#define PREFETCH_LINES 8 /* at most this many 64-byte lines of a row; longer rows stream by themselves */

/* -1 when every id is in 0..rows-1, else the position of the first that is not: one branch-free pass
 * (a negative id is huge as uint64), a second only to find the position */
static inline ptrdiff_t first_bad(const int64_t *ids, ptrdiff_t n, uint64_t rows)
{
    uint64_t bad = 0;
    for (ptrdiff_t i = 0; i < n; i++)
        bad |= (uint64_t)ids[i] >= rows;
    if (!bad)
        return -1;
    ptrdiff_t i = 0; /* bounded: another thread may have changed the ids since the first pass */
    while (i < n && (uint64_t)ids[i] < rows)
        i++;
    return i < n ? i : -1;
}

static inline void prefetch_row(const char *row, size_t row_bytes, size_t lines)
{
    for (size_t k = 0; k < lines; k++)
        __builtin_prefetch(row + 64 * k, 0, 0);
    __builtin_prefetch(row + row_bytes - 1, 0, 0);
}

static inline void copy_rows(const char *table, uint64_t rows, size_t row_bytes, const int64_t *ids, ptrdiff_t n,
                             char *out)
{
    size_t lines = (row_bytes + 63) / 64;
    if (lines > PREFETCH_LINES)
        lines = PREFETCH_LINES;
    for (ptrdiff_t i = 0; i < n && i < PREFETCH_ROWS; i++) {
        uint64_t id = (uint64_t)ids[i];
        prefetch_row(table + (id < rows ? id : rows - 1) * row_bytes, row_bytes, lines);
    }
    for (ptrdiff_t i = 0; i < n; i++) {
        if (i + PREFETCH_ROWS < n) {
            uint64_t ahead = (uint64_t)ids[i + PREFETCH_ROWS];
            prefetch_row(table + (ahead < rows ? ahead : rows - 1) * row_bytes, row_bytes, lines);
        }
        uint64_t id = (uint64_t)ids[i];
        memcpy(out + (size_t)i * row_bytes, table + (id < rows ? id : rows - 1) * row_bytes, row_bytes);
    }
}

#endif /* TABLESERVER_ROWCOPY_H */
