/* client/tableclient/graph/poller/_native_c/wire.h: the tcp wire protocol's constants as the native poller speaks
 * it, spelled once: tableserver/common/wire.py is the protocol (its docstring says what a frame holds); these
 * are its values, for C. tests/unit/test_wire_header.py checks every define here against wire.py (HEADER,
 * REQUEST_MAGIC, RESPONSE_MAGIC, FrameType, Status, FATAL, ROW_ID_BYTES) and fails for a FrameType or Status
 * member with no define here: a change to wire.py fails that test until this header follows it.
 *
 * A frame's 24-byte little-endian header (wire.HEADER, "<4sHHQII"):
 *   request  magic "TSQ1" | type u16 | flags u16  | request_id u64 | table u32     | count u32
 *   response magic "TSR1" | type u16 | status u16 | request_id u64 | row_bytes u32 | count u32
 * A GATHER's payload is `count` row ids of WIRE_ROW_ID_BYTES (int64); its OK carries count x row_bytes bytes,
 * an error response a message of `count` bytes instead. */
#ifndef TABLECLIENT_POLLER_WIRE_H
#define TABLECLIENT_POLLER_WIRE_H

#define WIRE_HEADER_BYTES 24       /* wire.HEADER_BYTES */
#define WIRE_MAGIC_BYTES 4         /* a frame's magic, the header's first field */
#define WIRE_REQUEST_MAGIC "TSQ1"  /* wire.REQUEST_MAGIC */
#define WIRE_RESPONSE_MAGIC "TSR1" /* wire.RESPONSE_MAGIC */

/* where each header field starts (wire.HEADER's fields, packed) */
#define WIRE_AT_TYPE 4
#define WIRE_AT_FLAGS 6  /* a request's; a response's status is here */
#define WIRE_AT_STATUS 6
#define WIRE_AT_REQUEST_ID 8
#define WIRE_AT_TABLE 16 /* a request's; a response's row_bytes is here */
#define WIRE_AT_ROW_BYTES 16
#define WIRE_AT_COUNT 20

/* wire.FrameType */
#define WIRE_FRAME_HELLO 1
#define WIRE_FRAME_GATHER 2
#define WIRE_FRAME_CHALLENGE 3

/* wire.Status */
#define WIRE_STATUS_OK 0
#define WIRE_STATUS_BAD_FRAME 1
#define WIRE_STATUS_UNAUTHENTICATED 2
#define WIRE_STATUS_UNKNOWN_TABLE 3
#define WIRE_STATUS_ROW_OUT_OF_RANGE 4
#define WIRE_STATUS_TOO_MANY_ROWS 5
#define WIRE_STATUS_SESSION_CLOSED 6
#define WIRE_STATUS_INTERNAL 7
#define WIRE_STATUS_BUSY 8
#define WIRE_STATUS_IO_ERROR 9

/* wire.FATAL: the server closes the connection after answering with one of these */
#define WIRE_STATUS_FATAL(status)                                                                                    \
    ((status) == WIRE_STATUS_BAD_FRAME || (status) == WIRE_STATUS_UNAUTHENTICATED ||                                 \
     (status) == WIRE_STATUS_TOO_MANY_ROWS || (status) == WIRE_STATUS_SESSION_CLOSED || (status) == WIRE_STATUS_BUSY)

#define WIRE_ROW_ID_BYTES 8 /* wire.ROW_ID_BYTES: a GATHER's row id, an int64 */

#endif /* TABLECLIENT_POLLER_WIRE_H */
