"""Metadata lives in setup.cfg; this adds the optional C extensions: the row gather (tableserver/common/take.py
says why), the flag wait of graph-safe steps (client/tableclient/_flags.c says why) and the disk tier's read
engine (tableserver/disk/_diskio_c/module.c says why; its C files, by concept, as CPython's Modules/_io/).

``optional=True``: without a C compiler or Python's headers the package installs all the same and
``tableserver.common.take`` runs numpy's gather (``tableserver.common.take.NATIVE`` is then False), and
``tableserver.disk.reader.DiskTable`` reads with its Python thread pool (``engine == "python"``).
``TABLESERVER_BUILD_NATIVE=0`` leaves it out on purpose: a pure wheel, for another Python version.
"""

import os

from setuptools import Extension, setup

# CI sets TABLESERVER_REQUIRE_NATIVE=1: a build error there fails the install (else an older .so of an
# in-place build would go on being imported)
optional = os.environ.get("TABLESERVER_REQUIRE_NATIVE") != "1"
# tableserver/common/bufcheck.h: the buffer checks _take and _diskio share. `depends` puts the headers in the
# sdist (and rebuilds an extension when one changes).
COMMON = "tableserver/common"
DISKIO = "tableserver/disk/_diskio_c"  # not _diskio/: with no .so built, that folder imports as the module
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
        "tableclient._flags",
        ["client/tableclient/_flags.c"],
        include_dirs=[COMMON],
        depends=[f"{COMMON}/spin.h"],
        optional=optional,
        extra_compile_args=["-O2"],
    ),
    # the in_graph poller and watchdog: one native thread per GraphStep (client/tableclient/_graphpoll.c says why)
    Extension(
        "tableclient._graphpoll",
        ["client/tableclient/_graphpoll.c"],
        include_dirs=[COMMON],
        depends=[f"{COMMON}/bufcheck.h", f"{COMMON}/rowcopy.h", f"{COMMON}/spin.h"],
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
setup(ext_modules=[] if os.environ.get("TABLESERVER_BUILD_NATIVE") == "0" else native)
