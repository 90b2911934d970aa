"""The CUDA driver's side of the graph wing: cuda-python's driver API (``cuda.bindings.driver``), every name this
package uses resolved at once by :func:`driver_symbols`, so that a name a cuda-bindings release lacks is one clear
error at start-up (and a CPU test against the real bindings), never an ``AttributeError`` at the first step; each
call's result checked into one line (:func:`check`)."""

from __future__ import annotations

from types import SimpleNamespace

from tableclient.graph.errors import GraphStepError

#: every name of ``cuda.bindings.driver`` this package uses (attribute paths)
DRIVER_NAMES = (
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuMemHostGetDevicePointer",
    "cuMemHostRegister",
    "cuMemHostUnregister",
    "cuStreamWriteValue32",
    "cuStreamWaitValue32",
    "cuGetErrorString",
    "CUdeviceptr",
    "CUstream",
    "CUresult.CUDA_SUCCESS",
    "CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ",
    "CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT",
    "CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED",
    "CUdevice_attribute.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED",
    "CU_MEMHOSTREGISTER_READ_ONLY",
    "CU_MEMHOSTREGISTER_DEVICEMAP",
    "CU_MEMHOSTREGISTER_PORTABLE",
)


def load_driver():
    """cuda-python's driver module; GraphStepError naming the package when it is not installed."""
    try:
        from cuda.bindings import driver
    except ImportError:
        raise GraphStepError(
            "served layers in CUDA graphs need cuda-bindings (pip install cuda-bindings; SGLang and vLLM "
            "require it already): install it, or place the layers 'before_replay'"
        ) from None
    return driver


def driver_symbols(driver=None) -> SimpleNamespace:
    """Every driver name this package uses, resolved now (attribute dots become underscores:
    ``CUresult_CUDA_SUCCESS``); GraphStepError naming the first one ``driver`` lacks. Needs no GPU."""
    driver = driver if driver is not None else load_driver()
    out = {"driver": driver}
    for name in DRIVER_NAMES:
        obj = driver
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            version = getattr(getattr(driver, "__spec__", None), "name", "cuda.bindings.driver")
            raise GraphStepError(
                f"{version} has no {name}: install a cuda-bindings release of CUDA 12 or 13, or place the "
                "layers 'before_replay'"
            ) from None
        out[name.replace(".", "_")] = obj
    return SimpleNamespace(**out)


def check(sym: SimpleNamespace, what: str, result, fix: str = "place the layers 'before_replay'") -> tuple:
    """``result`` of a driver call (a tuple led by its CUresult, or the CUresult); GraphStepError naming the
    call and the driver's error otherwise. Returns the call's values after the CUresult."""
    values = result if isinstance(result, tuple) else (result,)
    err = values[0]
    if err != sym.CUresult_CUDA_SUCCESS:
        try:
            _e, text = sym.cuGetErrorString(err)
            text = text.decode() if isinstance(text, bytes) else str(text)
        except Exception:  # an unknown code: its number is enough
            text = ""
        raise GraphStepError(f"{what} failed ({getattr(err, 'name', err)}{': ' + text if text else ''}): {fix}")
    return values[1:]


def device_handle(sym: SimpleNamespace, index: int):
    """The driver's CUdevice of ``index``; GraphStepError (one line) where no CUDA driver is loaded."""
    try:
        check(sym, "cuInit", sym.cuInit(0))  # idempotent; torch may not have touched CUDA yet
        (dev,) = check(sym, "cuDeviceGet", sym.cuDeviceGet(index))
    except GraphStepError:
        raise
    except Exception as e:  # cuda-pathfinder's DynamicLibNotFoundError, a RuntimeError: no libcuda here
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GraphStepError(
            f"no CUDA driver for device {index} ({first}): run on a GPU host, or place the layers 'before_replay'"
        ) from None
    return dev


def device_attribute(sym: SimpleNamespace, dev, attribute) -> int:
    (value,) = check(sym, "cuDeviceGetAttribute", sym.cuDeviceGetAttribute(attribute, dev))
    return int(value)


def device_index(torch, device) -> int:
    """The CUDA device index of ``device`` (a torch device, an index or None: the current one)."""
    if device is None:
        return int(torch.cuda.current_device())
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        raise GraphStepError(f"stream memory operations need a CUDA device, not {d}")
    return d.index if d.index is not None else int(torch.cuda.current_device())
