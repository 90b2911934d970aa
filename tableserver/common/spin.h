/* tableserver/common/spin.h: the clock and the spin hint of the extensions that wait for flags without the
 * GIL (client/tableclient/graph/_flags.c, client/tableclient/graph/poller/_native_c/). Plain C: safe without the GIL. */
#ifndef TABLESERVER_SPIN_H
#define TABLESERVER_SPIN_H

#include <stdint.h>
#include <time.h>

/* CLOCK_MONOTONIC in nanoseconds: time.monotonic()'s clock */
static inline int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ``seconds`` as nanoseconds, saturated to int64's range: a deadline of inf or 1e300 is "never", not a
 * wrapped negative number that has passed already; zero or less is 0. NaN gives 0: callers refuse it first. */
static inline int64_t seconds_to_ns(double seconds)
{
    if (!(seconds > 0))
        return 0;
    if (seconds >= 9.2e9) /* 9.2e18 ns: INT64_MAX is 9.22e18 */
        return INT64_MAX;
    return (int64_t)(seconds * 1e9);
}

/* one turn of a spin: the CPU's pause hint (a spinning core leaves its sibling the pipeline) */
static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

#endif /* TABLESERVER_SPIN_H */
