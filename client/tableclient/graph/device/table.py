"""A node table read by the GPU itself: this host's daemon's sealed table mapping, registered with CUDA
read-only and mapped, gathered by a kernel inside a captured decode graph (graph mode ``device``).

A ``node`` layer's table is already mapped into this process (the shm transport maps the daemon's
sealed memfd): the same kind of mapping SGLang's host table registers with ``cudaHostRegister`` and
vLLM's ``cpu_offload`` reads over UVA. :class:`DeviceTable` registers it
(``cuMemHostRegister(READ_ONLY | DEVICEMAP | PORTABLE)``, after checking
``READ_ONLY_HOST_REGISTER_SUPPORTED`` and the memlock limit) and keeps its device address in a one-element
device tensor, :attr:`DeviceTable.pointer`, that the kernel reads at every replay: a table mapped anew
(the daemon restarted; the client pins the table's checksum, so a restart on other data is never
mapped) is registered and the pointer rewritten without capturing again. :func:`gather` launches the
kernel: rows ``ids`` of the table into ``out`` (packed rows: weights, then scale bytes), in words of 8
bytes where the row allows. An id outside the table, a dead id (negative) and a table not mapped now
(pointer 0) give zero rows: the kernel never reads outside the registered table.

Invariants: a mapping stays registered, and mapped, until every replay queued before its replacement
finished (:meth:`DeviceTable.refresh` synchronizes the device before it lets one go); the kernel reads
the pointer on the device, so no replay ever reads a page the host unmapped. Without CUDA (the tests,
an engine on the CPU) nothing is registered: the pointer is the host address and the kernel runs in
Triton's interpreter.
"""

from __future__ import annotations

import logging
import os
import resource
import threading

from tableclient.graph.cuda import check, device_attribute, device_handle, device_index, driver_symbols
from tableclient.graph.errors import GraphStepError

log = logging.getLogger(__name__)

#: rows a kernel program gathers
BLOCK_ROWS = 16


class DeviceTableUnavailable(GraphStepError):
    """A table cannot be read by the GPU here (why, in one line): its layer takes the host path."""


def memlock_refusal(nbytes: int, limit: int | None = None, euid: int | None = None) -> str | None:
    """Why ``nbytes`` of host memory cannot be page-locked under this process's memlock limit (None:
    they can). Root (CAP_IPC_LOCK) is not limited."""
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] if limit is None else limit
    euid = os.geteuid() if euid is None else euid
    if euid == 0 or soft == resource.RLIM_INFINITY or soft >= nbytes:
        return None
    return (
        f"locking its {nbytes / 2**30:.2f} GiB needs a memlock limit of at least that, this process has "
        f"{soft / 2**30:.2f} GiB (ulimit -l unlimited, or the container's --ulimit memlock=-1)"
    )


class DeviceTable:
    """Table ``name`` of ``client`` (``rows`` rows of ``row_bytes``), readable by a kernel on ``device``
    through :attr:`pointer`. DeviceTableUnavailable (one line) when it cannot be: not mapped in this
    process, no read-only host registration on this GPU, a memlock limit below its size, the driver's
    refusal. ``register=False`` on a CUDA device: the table must already be readable at its host address
    (tests)."""

    def __init__(self, client, name: str, device, *, torch=None, register: bool = True):
        if torch is None:
            import torch
        self.torch, self.name = torch, name
        info = client.tables[name]
        self.rows, self.row_bytes = int(info.rows), int(info.row_bytes)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._reader = client.reader(name)
        self._lock = threading.Lock()
        self._local = None  # the array of the mapping registered now (keeps that mapping alive)
        self._registered: int | None = None  # host address registered with CUDA
        self.generation = 0  # bumped at every change of the mapping read
        self.error: str | None = None  # why the table is not readable now (its pointer is 0)
        self.pointer = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._sym = None
        if self.cuda and register:
            self._sym = driver_symbols()
            dev = device_handle(self._sym, device_index(torch, self.device))
            for attr, what in (
                ("CUdevice_attribute_CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED", "register host memory"),
                (
                    "CUdevice_attribute_CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED",
                    "map read-only host memory",
                ),
            ):
                if not device_attribute(self._sym, dev, getattr(self._sym, attr)):
                    raise DeviceTableUnavailable(
                        f"table {name!r}: this GPU cannot {what} ({attr.split('ATTRIBUTE_')[-1]} = 0)"
                    )
        if not self.refresh():
            raise DeviceTableUnavailable(f"table {name!r}: {self.error}")

    def refresh(self) -> bool:
        """Before a replay: the mapping the client reads this table through now, registered and in
        :attr:`pointer` (a new one replaces the old once the device finished every queued replay).
        Returns whether the table is readable; False (its pointer 0, the reason in :attr:`error`) while
        no mapping is there (the daemon down, another node serving it)."""
        local = self._reader.local()
        if local is self._local and (local is not None or self.error is not None):
            return local is not None
        with self._lock:
            if local is self._local and (local is not None or self.error is not None):
                return local is not None
            self._release()
            self.generation += 1
            if local is None:
                self.error = "not mapped in this process (its node is down, or serves it from disk or over the network)"
                return False
            try:
                address = self._register(local)
            except GraphStepError as e:
                self.error = str(e)
                return False
            self._local, self.error = local, None
            self.pointer.fill_(address)
            if self.generation > 1:
                log.warning(
                    "table %r: mapped anew (its node restarted): registered again, pointer rewritten", self.name
                )
            return True

    def _register(self, local) -> int:
        """The address the device reads ``local`` at (registered with CUDA on a GPU)."""
        host = int(local.ctypes.data)
        if local.shape != (self.rows, self.row_bytes):
            raise GraphStepError(f"mapped as {local.shape}, the catalog says ({self.rows}, {self.row_bytes})")
        if self._sym is None:
            return host
        why = memlock_refusal(local.nbytes)
        if why is not None:
            raise DeviceTableUnavailable(f"table {self.name!r}: {why}")
        s = self._sym
        flags = (
            int(s.CU_MEMHOSTREGISTER_READ_ONLY)
            | int(s.CU_MEMHOSTREGISTER_DEVICEMAP)
            | int(s.CU_MEMHOSTREGISTER_PORTABLE)
        )
        fix = "place the layer's graph mode 'before_replay' (or free pinned host memory)"
        check(s, "cuMemHostRegister", s.cuMemHostRegister(host, local.nbytes, flags), fix)
        self._registered = host
        try:
            (address,) = check(s, "cuMemHostGetDevicePointer", s.cuMemHostGetDevicePointer(host, 0), fix)
        except GraphStepError:
            self._release()
            raise
        return int(address)

    def _release(self) -> None:
        """(lock held) Lets the registered mapping go, once no queued replay can still read it."""
        if self._local is None and self._registered is None:
            return
        self.pointer.fill_(0)
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
        if self._registered is not None:
            s, self._registered, host = self._sym, None, self._registered
            check(s, "cuMemHostUnregister", s.cuMemHostUnregister(host))
        self._local = None

    def close(self) -> None:
        """Unregisters the table (after the device finished its queued work). Idempotent."""
        with self._lock:
            self._release()
            self.error = "closed"

    def __repr__(self) -> str:
        state = "readable" if self._local is not None else f"unreadable: {self.error}"
        return f"DeviceTable({self.name!r}, {self.rows} x {self.row_bytes} B, {self.device}, {state})"


def word_dtype(torch, row_bytes: int):
    """The widest word a row of ``row_bytes`` divides into (8, 4 or 1 bytes)."""
    return torch.int64 if row_bytes % 8 == 0 else torch.int32 if row_bytes % 4 == 0 else torch.uint8


def gather(table: DeviceTable, ids, out) -> None:
    """Queues on the current stream the kernel that gathers rows ``ids`` (any integer dtype, contiguous,
    on ``table``'s device; N of them) of ``table`` into ``out[:N]`` (uint8 ``[>= N, row_bytes]``,
    contiguous). Capturable: inside a graph capture it becomes a kernel node reading
    :attr:`DeviceTable.pointer` at every replay."""
    torch = table.torch
    flat = ids.reshape(-1)
    n = flat.shape[0]
    if out.dtype != torch.uint8 or out.dim() != 2 or out.shape[1] != table.row_bytes or out.shape[0] < n:
        raise ValueError(f"out must be uint8 [>= {n}, {table.row_bytes}], got {out.dtype} {tuple(out.shape)}")
    if not out.is_contiguous() or not flat.is_contiguous() or out.device != flat.device:
        raise ValueError("ids and out must be contiguous and on one device")
    if n == 0:
        return
    word = word_dtype(torch, table.row_bytes)
    size = {torch.int64: 8, torch.int32: 4}.get(word, 1)
    words = table.row_bytes // size
    block_w = 1 << (words - 1).bit_length()
    grid = ((n + BLOCK_ROWS - 1) // BLOCK_ROWS,)
    from tableclient.graph.device import kernel as rowkernel

    kernel = rowkernel.compiled if out.is_cuda else rowkernel.interpreted
    kernel[grid](table.pointer, flat, out.view(word), n, table.rows, WORDS=words, BLOCK_R=BLOCK_ROWS, BLOCK_W=block_w)
