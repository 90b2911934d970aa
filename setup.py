"""Metadata lives in setup.cfg; this adds the optional C extensions: the row gather (tableserver/common/take.py
says why), the flag wait of graph-safe steps (client/tableclient/graph/_flags.c says why) and the disk tier's read
engine (tableserver/disk/_diskio_c/module.c says why; its C files, by concept, as CPython's Modules/_io/); where
libibverbs' headers are, the in_graph poller's rdma source (client/tableclient/graph/poller/_native_c/verbs.c).

``optional=True``: without a C compiler or Python's headers the package installs all the same and
``tableserver.common.take`` runs numpy's gather (``tableserver.common.take.NATIVE`` is then False), and
``tableserver.disk.reader.DiskTable`` reads with its Python thread pool (``engine == "python"``).
``TABLESERVER_BUILD_NATIVE=0`` leaves it out on purpose: a pure wheel, for another Python version.
"""

import os
import sysconfig

from setuptools import Extension, setup


def has_header(name: str) -> bool:
    """Whether the C compiler finds header ``name`` in the usual places (CPATH, C_INCLUDE_PATH, Python's include
    directory, /usr/local/include, /usr/include and its multiarch directory)."""
    dirs = [d for var in ("CPATH", "C_INCLUDE_PATH") for d in os.environ.get(var, "").split(os.pathsep) if d]
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs += [sysconfig.get_path("include"), "/usr/local/include", f"/usr/include/{multiarch}", "/usr/include"]
    return any(os.path.exists(os.path.join(d, name)) for d in dirs if d)


# CI sets TABLESERVER_REQUIRE_NATIVE=1: a build error there fails the install (else an older .so of an
# in-place build would go on being imported)
optional = os.environ.get("TABLESERVER_REQUIRE_NATIVE") != "1"
# tableserver/common/bufcheck.h: the buffer checks _take and _diskio share. `depends` puts the headers in the
# sdist (and rebuilds an extension when one changes).
COMMON = "tableserver/common"
DISKIO = "tableserver/disk/_diskio_c"  # not _diskio/: with no .so built, that folder imports as the module
GRAPH = "client/tableclient/graph"
POLLER = (
    f"{GRAPH}/poller/_native_c"  # the native poller's C, by concept; verbs.h: what _verbs hands _native (a capsule)
)
native = [
    Extension(
        "tableserver.common._take",
        [f"{COMMON}/_take.c"],
        include_dirs=[COMMON],
        depends=[f"{COMMON}/bufcheck.h", f"{COMMON}/rowcopy.h"],
        optional=optional,
        extra_compile_args=["-O2"],
    ),
    Extension(
        "tableclient.graph._flags",
        [f"{GRAPH}/_flags.c"],
        include_dirs=[COMMON],
        depends=[f"{COMMON}/spin.h"],
        optional=optional,
        extra_compile_args=["-O2"],
    ),
    # the in_graph poller and watchdog: one native thread per GraphStep (its module.c and loop.c say why; what its
    # files share: poller.h; the wire's constants: wire.h)
    Extension(
        "tableclient.graph.poller._native",
        [f"{POLLER}/{name}.c" for name in ("module", "source", "loop", "tcp")],
        include_dirs=[COMMON],
        depends=[f"{COMMON}/{h}.h" for h in ("bufcheck", "rowcopy", "spin")]
        + [f"{POLLER}/{h}.h" for h in ("poller", "wire", "verbs")],
        optional=optional,
        extra_compile_args=["-O2"],
    ),
    Extension(
        "tableserver.disk._diskio",
        [f"{DISKIO}/{name}.c" for name in ("module", "queue", "threads", "uring")],
        include_dirs=[COMMON],
        depends=[f"{DISKIO}/engine.h", f"{COMMON}/bufcheck.h"],
        optional=optional,
        extra_compile_args=["-O2"],
    ),
]
# the in_graph poller's rdma source (its verbs.c says why it is a module of its own): only
# where libibverbs' headers are (Debian: libibverbs-dev), so that a client without RDMA builds and imports all the same
if has_header("infiniband/verbs.h"):
    native.append(
        Extension(
            "tableclient.graph.poller._verbs",
            [f"{POLLER}/verbs.c"],
            include_dirs=[COMMON],
            depends=[f"{COMMON}/bufcheck.h", f"{COMMON}/rowcopy.h", f"{COMMON}/spin.h", f"{POLLER}/verbs.h"],
            libraries=["ibverbs"],
            optional=optional,
            extra_compile_args=["-O2"],
        )
    )
setup(ext_modules=[] if os.environ.get("TABLESERVER_BUILD_NATIVE") == "0" else native)
