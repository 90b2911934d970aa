"""The CUDA side of the graph-safe step built against the real cuda-bindings on a machine with no GPU: every
driver name it uses resolves (a name a release lacks, like the CAN_USE_STREAM_MEM_OPS attribute CUDA 12+
removed, is caught here, not at the first in_graph step on a GPU), and constructing the stream ops
without a driver ends in one line naming what to do, never an AttributeError."""

from __future__ import annotations

import types

import pytest
from tableclient.graph.cuda import DRIVER_NAMES, driver_symbols
from tableclient.graph.errors import GraphStepError
from tableclient.graph.streams import CudaStreamOps

driver = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is in the dev extras")


def test_every_driver_name_used_resolves_in_the_installed_cuda_bindings():
    sym = driver_symbols(driver)
    for name in DRIVER_NAMES:
        assert getattr(sym, name.replace(".", "_")) is not None
    assert int(sym.CU_MEMHOSTREGISTER_READ_ONLY) == 8  # the flag the device tables register with
    # the attribute the first version asked for, which would have crashed the first in_graph step
    assert not hasattr(driver.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS")


def test_a_name_missing_from_the_bindings_is_one_line_naming_it():
    lacking = types.SimpleNamespace(**{n: getattr(driver, n) for n in dir(driver) if n != "cuStreamWaitValue32"})
    with pytest.raises(GraphStepError, match="has no cuStreamWaitValue32: install a cuda-bindings release") as e:
        driver_symbols(lacking)
    assert "\n" not in str(e.value)


def test_the_stream_ops_without_a_driver_refuse_in_one_line_with_the_mode_to_use():
    """The code path GraphStep builds for in_graph layers on a GPU, up to its first driver call: here the
    driver library is absent, which must be a GraphStepError naming before_replay."""
    with pytest.raises(GraphStepError, match="no CUDA driver for device 0 .*place the layers 'before_replay'") as e:
        CudaStreamOps(None, 0)
    assert "\n" not in str(e.value)
