"""The stream's side of a graph-safe step's flags: host-visible uint32 a captured CUDA graph writes and
waits for (:mod:`tableclient.graph.step` holds the protocol).

* :class:`CudaStreamOps` queues ``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` (cuda-python's driver
  API, ``cuda.bindings.driver``) on the current stream: inside a capture they become the graph's
  memory-operation nodes. CUDA 12+ gates 32-bit stream memory operations by no device attribute (the
  bindings have no ``CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS``, only the deprecated ``..._V1``), so
  whether they work on this device and driver is found out by :func:`probe`, once per device, before
  any graph depends on them: capture a write and a wait into a tiny graph, replay it, release it from
  a host thread, synchronize, all within a bounded wait. A probe that fails refuses with one line and
  the mode to use instead.
* :class:`HostStreamOps` runs the same protocol on the host in the calling thread (an engine without a
  GPU; the tests).

The driver's names come from :mod:`tableclient.graph.cuda`.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np

from tableclient.graph.cuda import check, device_handle, device_index, driver_symbols
from tableclient.graph.errors import GraphStepError

#: uint32 per flag: each on a 64-byte line of its own (a poller's reads never share the GPU's line)
FLAG_STRIDE = 16
#: how long the start-up probe waits for its tiny graph (seconds)
PROBE_TIMEOUT_S = 5.0

#: the flag wait without the GIL (tableclient.graph._flags.wait_u32); None where it is not built
try:
    from tableclient.graph._flags import wait_u32 as native_wait
except ImportError:  # built without a C compiler
    native_wait = None


def wait_flag(flags: np.ndarray, index: int, value: int, timeout: float) -> bool:
    """Whether ``flags[index]`` became ``value`` within ``timeout`` seconds; waited for without the GIL
    where the native module is built (a Python loop of 20 us sleeps otherwise)."""
    if native_wait is not None:
        return native_wait(flags, index, value, max(timeout, 0.0))
    end = time.monotonic() + timeout
    while int(flags[index]) != value:
        if time.monotonic() >= end:
            return False
        time.sleep(20e-6)
    return True


class HostStreamOps:
    """The stream's side of the flags, run on the host by the calling thread: what a CUDA stream does in
    the graph, for an engine without one (and the tests). ``wait`` gives up after ``timeout``."""

    name = "host"

    def __init__(self, timeout: float = 60.0):
        self.timeout = timeout

    def write(self, flags: GraphFlags, index: int, value: int) -> None:
        flags.host[index] = value

    def wait(self, flags: GraphFlags, index: int, value: int) -> None:
        if not wait_flag(flags.host, index, value, self.timeout):
            raise GraphStepError(f"flag {index} did not become {value} within {self.timeout:g} s")


_probed: dict = {}  # device index -> None (passed) or the refusal's message
_probe_lock = threading.Lock()


class CudaStreamOps:
    """Flag writes and waits queued on the current CUDA stream (cuda-python's driver API): inside a
    graph capture they become memory-operation nodes, replayed with the graph. Built only once
    :func:`probe` passed on the device (``probe=False``: the caller has run it)."""

    name = "cuda"

    def __init__(self, torch, device=None, probe: bool = True, sym: SimpleNamespace | None = None):
        self.sym = sym if sym is not None else driver_symbols()
        index = device_index(torch, device)
        device_handle(self.sym, index)  # a driver to talk to, before torch's CUDA is touched
        self.torch, self.index = torch, index
        self._eq = int(self.sym.CUstreamWaitValue_flags_CU_STREAM_WAIT_VALUE_EQ)
        self._write = int(self.sym.CUstreamWriteValue_flags_CU_STREAM_WRITE_VALUE_DEFAULT)
        if probe:
            probe_device(torch, index, self.sym)

    def _stream(self):
        return self.sym.CUstream(self.torch.cuda.current_stream().cuda_stream)

    def device_pointer(self, host_ptr: int) -> int:
        (ptr,) = check(self.sym, "cuMemHostGetDevicePointer", self.sym.cuMemHostGetDevicePointer(host_ptr, 0))
        return int(ptr)

    def write(self, flags: GraphFlags, index: int, value: int) -> None:
        self.write_at(flags.device_ptr(self, index), value)

    def wait(self, flags: GraphFlags, index: int, value: int) -> None:
        self.wait_at(flags.device_ptr(self, index), value)

    def write_at(self, device_ptr: int, value: int) -> None:
        s = self.sym
        check(
            s,
            "cuStreamWriteValue32",
            s.cuStreamWriteValue32(self._stream(), s.CUdeviceptr(device_ptr), value, self._write),
        )

    def wait_at(self, device_ptr: int, value: int) -> None:
        s = self.sym
        check(
            s, "cuStreamWaitValue32", s.cuStreamWaitValue32(self._stream(), s.CUdeviceptr(device_ptr), value, self._eq)
        )


def probe_device(torch, index: int, sym: SimpleNamespace | None = None, timeout: float = PROBE_TIMEOUT_S) -> float:
    """The start-up probe of stream memory operations on CUDA device ``index`` (cached: one per device
    and process): a tiny graph captured with ``write ids = 1; wait rows == 1; write rows = 0``, replayed,
    released by a host thread once it sees ``ids``, and waited for within ``timeout`` seconds. Returns
    the seconds it took; GraphStepError (one line, the mode to use instead) when it fails, every later
    call the same."""
    with _probe_lock:
        if index in _probed:
            if _probed[index] is not None:
                raise GraphStepError(_probed[index])
            return 0.0
        t0 = time.monotonic()
        try:
            _probe(torch, index, sym if sym is not None else driver_symbols(), timeout)
        except GraphStepError as e:
            _probed[index] = (
                f"CUDA device {index}: stream memory operations failed the start-up probe ({e}): "
                "place the layers 'before_replay'"
            )
            raise GraphStepError(_probed[index]) from None
        _probed[index] = None
        return time.monotonic() - t0


def _probe(torch, index: int, sym: SimpleNamespace, timeout: float) -> None:
    device = torch.device("cuda", index)
    flags = torch.zeros(2 * FLAG_STRIDE, dtype=torch.int32, pin_memory=True)
    host = flags.numpy().view(np.uint32)
    ops = CudaStreamOps(torch, device, probe=False, sym=sym)
    base = ops.device_pointer(flags.data_ptr())
    ids_at, rows_at = base, base + 4 * FLAG_STRIDE
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    try:
        with torch.cuda.device(device), torch.cuda.graph(graph, stream=stream):
            ops.write_at(ids_at, 1)
            ops.wait_at(rows_at, 1)
            ops.write_at(rows_at, 0)
    except GraphStepError:
        raise
    except Exception as e:  # the capture itself refused (torch's RuntimeError)
        raise GraphStepError(f"capture: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    released = threading.Event()

    def release():
        if wait_flag(host, 0, 1, timeout):
            host[0] = 0
            host[FLAG_STRIDE] = 1
            released.set()

    helper = threading.Thread(target=release, name="tableclient-probe", daemon=True)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        helper.start()
        graph.replay()
        end = time.monotonic() + timeout
        while not stream.query():
            if time.monotonic() >= end:
                host[FLAG_STRIDE] = 1  # never leave a stream waiting: let it finish, then refuse
                stream.synchronize()
                raise GraphStepError(
                    "the graph's ids flag never reached the host"
                    if not released.is_set()
                    else "the graph did not see the host's release"
                )
            time.sleep(50e-6)
        stream.synchronize()
    helper.join(timeout)
    if not released.is_set() or int(host[FLAG_STRIDE]) != 0:
        raise GraphStepError(f"the graph ran but left the flags at ids {int(host[0])}, rows {int(host[FLAG_STRIDE])}")
    del graph


class GraphFlags:
    """The host-visible flags of every in_graph layer: uint32 in pinned memory, one 64-byte line each; per layer
    ``ids``, ``rows`` and ``ok`` (whether the step's rows are the table's, not the policy's)."""

    PER_SLOT = 3

    def __init__(self, torch, count: int, pin: bool):
        self.tensor = torch.zeros(max(count, 1) * self.PER_SLOT * FLAG_STRIDE, dtype=torch.int32, pin_memory=pin)
        self.host = self.tensor.numpy().view(np.uint32)
        self._device_base: int | None = None

    def index(self, slot: int, which: int) -> int:
        return (self.PER_SLOT * slot + which) * FLAG_STRIDE

    def device_ptr(self, ops: CudaStreamOps, index: int) -> int:
        if self._device_base is None:
            self._device_base = ops.device_pointer(self.tensor.data_ptr())
        return self._device_base + 4 * index
