/* client/tableclient/graph/poller/_native_c/tcp.c: a slot's gather over tcp, against the step's deadline -- the
 * socket waited on with poll(2) (never past the deadline), a request written (put_request, send_request), a
 * response read (read_response: an error frame said, fatal or not as the wire says), the step's requests
 * pipelined (gather_tcp), and whether the server closed an idle connection (peer_closed). The frames are the
 * wire protocol's (tableserver/common/wire.py; its constants in wire.h). */
#include "poller.h"

#define MAX_ERROR_BODY 4096 /* an error frame's message read at most (else the connection is dropped) */
#define REQUESTS_IN_FLIGHT 2 /* tcp: a request sent ahead while the one before is answered (never blocking on it) */

/* Waits for ``events`` on fd until ``deadline``: 0, -ETIMEDOUT past it, -EPIPE on an error, or -errno */
static int wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        int64_t left = deadline - now_ns();
        if (left <= 0)
            return -ETIMEDOUT;
        int64_t ms = left / 1000000 + 1;
        struct pollfd pfd = {fd, events, 0};
        int r = poll(&pfd, 1, ms > 60000 ? 60000 : (int)ms); /* a far deadline: looked at again each minute */
        if (r > 0) {
            if (pfd.revents & (POLLERR | POLLNVAL))
                return -EPIPE;
            return 0;
        }
        if (r < 0 && errno != EINTR)
            return -errno;
    }
}

/* Whether the server closed (or reset) a connection that owes this side nothing: 1 closed (a hang-up, an error,
 * the stream's end), 0 open, -1 bytes nobody asked for are waiting on it (a server out of step). Never reads. */
int poller_peer_closed(int fd)
{
    struct pollfd pfd = {fd, POLLIN | POLLRDHUP, 0};
    int r;
    do
        r = poll(&pfd, 1, 0);
    while (r < 0 && errno == EINTR);
    if (r <= 0)
        return 0;
    if (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))
        return 1;
    char c;
    ssize_t k = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
        return 1;
    return k > 0 ? -1 : 0;
}

/* Writes one request -- its header, then its n bytes of ids -- from byte *off on, header and ids in one
 * sendmsg where the socket takes both (the server wakes once, as for the Python client's requests). With
 * ``block`` it waits for room until ``deadline`` until all is written; without, it returns -EAGAIN as soon as
 * the socket takes no more (*off says how far it got). 0 once all is written, else -errno (-ETIMEDOUT). */
static int send_request(int fd, const char *header, const char *ids, size_t n, size_t *off, int block,
                        int64_t deadline)
{
    while (*off < WIRE_HEADER_BYTES + n) {
        struct iovec iov[2];
        int k = 0;
        if (*off < WIRE_HEADER_BYTES)
            iov[k++] = (struct iovec){(void *)(header + *off), WIRE_HEADER_BYTES - *off};
        size_t at = *off > WIRE_HEADER_BYTES ? *off - WIRE_HEADER_BYTES : 0;
        if (n > at)
            iov[k++] = (struct iovec){(void *)(ids + at), n - at};
        struct msghdr msg = {0};
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)k;
        ssize_t w = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w > 0) {
            *off += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (!block)
                return -EAGAIN;
            int r = wait_fd(fd, POLLOUT, deadline);
            if (r < 0)
                return r;
            continue;
        }
        return w < 0 ? -errno : -EPIPE;
    }
    return 0;
}

/* Reads n bytes by the deadline; *got counts every byte read (of any response of the step) */
static int recv_all(int fd, char *buf, size_t n, int64_t deadline, size_t *got)
{
    while (n) {
        ssize_t r = recv(fd, buf, n, MSG_DONTWAIT);
        if (r > 0) {
            buf += r;
            n -= (size_t)r;
            *got += (size_t)r;
            continue;
        }
        if (r == 0)
            return -ECONNRESET;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int w = wait_fd(fd, POLLIN, deadline);
            if (w < 0)
                return w;
            continue;
        }
        return -errno;
    }
    return 0;
}

static void put_request(char *h, uint64_t request_id, uint32_t table, uint32_t count)
{
    uint16_t type = WIRE_FRAME_GATHER, flags = 0;
    memcpy(h, WIRE_REQUEST_MAGIC, WIRE_MAGIC_BYTES);
    memcpy(h + WIRE_AT_TYPE, &type, 2);
    memcpy(h + WIRE_AT_FLAGS, &flags, 2);
    memcpy(h + WIRE_AT_REQUEST_ID, &request_id, 8);
    memcpy(h + WIRE_AT_TABLE, &table, 4);
    memcpy(h + WIRE_AT_COUNT, &count, 4);
}

/* (a failed read or write) s->error says why; the step may be sent again elsewhere (GATHER_RESEND) where the
 * server had closed the connection before this side read a byte of the step's responses (its idle timeout, a
 * restart): nothing of the step was read, and reads are idempotent */
static int io_failed(Slot *s, int r, size_t answered, const char *what)
{
    s->timed_out = r == -ETIMEDOUT;
    if (s->timed_out)
        snprintf(s->error, ERROR_CHARS, "%s", what);
    else
        snprintf(s->error, ERROR_CHARS, "%s", strerror(-r));
    return !answered && (r == -ECONNRESET || r == -EPIPE) ? GATHER_RESEND : -1;
}

/* One response: its rows into out (count ids of row_bytes); 0, -1 with the error (*fatal: broken), or
 * GATHER_RESEND */
static int read_response(Slot *s, uint64_t request_id, uint32_t count, char *out, int64_t deadline, int *fatal,
                         size_t *answered)
{
    char h[WIRE_HEADER_BYTES];
    int r = recv_all(s->fd, h, WIRE_HEADER_BYTES, deadline, answered);
    if (r < 0) {
        *fatal = 1;
        return io_failed(s, r, *answered, "rows not in place by the deadline (watchdog)");
    }
    uint16_t type, status;
    uint64_t rid;
    uint32_t row_bytes, n;
    memcpy(&type, h + WIRE_AT_TYPE, 2);
    memcpy(&status, h + WIRE_AT_STATUS, 2);
    memcpy(&rid, h + WIRE_AT_REQUEST_ID, 8);
    memcpy(&row_bytes, h + WIRE_AT_ROW_BYTES, 4);
    memcpy(&n, h + WIRE_AT_COUNT, 4);
    if (memcmp(h, WIRE_RESPONSE_MAGIC, WIRE_MAGIC_BYTES) || type != WIRE_FRAME_GATHER || rid != request_id) {
        *fatal = 1;
        snprintf(s->error, ERROR_CHARS, "a response no tableserver sends (request %llu)", (unsigned long long)rid);
        return -1;
    }
    if (status != WIRE_STATUS_OK) {
        char msg[MAX_ERROR_BODY + 1];
        if (n > MAX_ERROR_BODY || recv_all(s->fd, msg, n, deadline, answered) < 0) {
            *fatal = 1;
            snprintf(s->error, ERROR_CHARS, "the server refused the gather (status %u)", status);
            return -1;
        }
        msg[n] = 0;
        /* the wire's fatal statuses close the connection after the answer */
        *fatal = WIRE_STATUS_FATAL(status);
        snprintf(s->error, ERROR_CHARS, "the server refused the gather (status %u): %.180s", status, msg);
        return -1;
    }
    if (row_bytes != s->row_bytes || n != count) {
        *fatal = 1;
        snprintf(s->error, ERROR_CHARS, "a response of %u rows of %u B for %u of %zu B", n, row_bytes, count,
                 s->row_bytes);
        return -1;
    }
    r = recv_all(s->fd, out, (size_t)count * s->row_bytes, deadline, answered);
    if (r < 0) {
        *fatal = 1;
        return io_failed(s, r, *answered, "rows not in place by the deadline (watchdog)");
    }
    return 0;
}

/* The step's n ids over tcp, at most max_rows a request. A request goes out ahead while the one before is
 * answered (REQUESTS_IN_FLIGHT), but only as far as the socket takes it at once: this thread never waits to
 * send while a response is owed to it (the server may be waiting to write that response, its own buffers
 * full of rows this side does not read: both would wait until the deadline); it reads that response first,
 * then sends the rest. 0; -1 (s->error, *fatal: the connection is not read again); GATHER_RESEND (the server
 * had closed the connection: nothing read, *fatal) */
int poller_gather_tcp(Slot *s, const int64_t *ids, size_t n, char *out, int64_t deadline, int *fatal)
{
    int closed = poller_peer_closed(s->fd); /* one poll(): the server's idle timeout found before a byte is sent */
    if (closed) {
        *fatal = 1;
        snprintf(s->error, ERROR_CHARS, "%s",
                 closed > 0 ? "the server had closed the connection" : "bytes nobody asked for on the connection");
        return closed > 0 ? GATHER_RESEND : -1;
    }
    size_t chunk = s->max_rows ? s->max_rows : n;
    if (chunk > UINT32_MAX) /* a frame's count is 32 bits */
        chunk = UINT32_MAX;
    size_t nreq = (n + chunk - 1) / chunk, sent = 0, done = 0, off = 0, answered = 0;
    char h[WIRE_HEADER_BYTES];
    uint64_t first = s->request_id;
    while (done < nreq) {
        while (sent < nreq && sent < done + REQUESTS_IN_FLIGHT) {
            size_t lo = sent * chunk, cnt = n - lo < chunk ? n - lo : chunk;
            put_request(h, first + sent, (uint32_t)s->table_index, (uint32_t)cnt);
            int r = send_request(s->fd, h, (const char *)(ids + lo), cnt * WIRE_ROW_ID_BYTES, &off, sent == done, deadline);
            if (r == -EAGAIN)
                break; /* a response is owed: read it first (only a request with none owed waits to be sent) */
            if (r < 0) {
                *fatal = 1;
                return io_failed(s, r, answered, "the request not sent by the deadline (watchdog)");
            }
            sent++;
            off = 0;
        }
        size_t lo = done * chunk, cnt = n - lo < chunk ? n - lo : chunk;
        int r = read_response(s, first + done, (uint32_t)cnt, out + lo * s->row_bytes, deadline, fatal, &answered);
        if (r < 0) {
            if (!*fatal && (done + 1 < sent || off)) /* a request in flight or half written: mid-frame */
                *fatal = 1;
            return r;
        }
        done++;
    }
    s->request_id = first + nreq;
    return 0;
}
