"""``tableserver doctor``: what this host lacks for tableserver, and the fix for pyverbs.

pyverbs (rdma-core's Python bindings) must match the rdma-core userspace of
the host it runs on, so it cannot come from PyPI for most hosts: PyPI's sdist
builds its own rdma-core (>= 59) and then fails to import against a
distribution's older libibverbs. The working install is the distribution's
own package (Debian/Ubuntu/Fedora: ``python3-pyverbs``) made importable from
the virtual environment the client or server runs in:

    tableserver doctor --fix-pyverbs

links that package (a directory holding only a ``pyverbs`` symlink, added to
the environment by a ``.pth`` file, so nothing else of the system's
site-packages leaks in), then proves it in a fresh interpreter: the import
works, the libibverbs it loads provides every verbs symbol version pyverbs
was built against, and the devices it sees are listed.

Checks print one line each (``ok``, ``warn``, ``FAIL``) and name the fix;
``doctor`` exits 1 when any check fails.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import sysconfig

from tableserver.errors import TableServerError
from tableserver.ops import host_checks
from tableserver.ops.findings import Finding, failed
from tableserver.tables.atomic import write_atomic

LINK_DIR_NAME = "tableserver-pyverbs"
PTH_NAME = "tableserver-pyverbs.pth"
_VERSION_RE = re.compile(rb"IBVERBS_(?:PRIVATE_\d+|1\.\d+)")
#: how long probing pyverbs in a fresh interpreter may take (it imports pyverbs and lists the RDMA devices)
PROBE_TIMEOUT_S = 120


class DoctorError(TableServerError):
    """A check the user asked to pass (``--fix-pyverbs``) cannot pass here; the message says why and what to do."""


# ------------------------------------------------------------------ where pyverbs comes from
def system_pyverbs_dirs() -> list[str]:
    """Distribution pyverbs packages on this host (Debian/Ubuntu, then Fedora/RHEL/SUSE layouts)."""
    patterns = [
        "/usr/lib/python3/dist-packages/pyverbs",
        "/usr/lib/python3*/site-packages/pyverbs",
        "/usr/lib64/python3*/site-packages/pyverbs",
        "/usr/local/lib/python3*/dist-packages/pyverbs",
        "/usr/local/lib64/python3*/site-packages/pyverbs",
    ]
    found = []
    for pattern in patterns:
        for d in sorted(glob.glob(pattern)):
            if os.path.isfile(os.path.join(d, "__init__.py")) and os.path.realpath(d) not in map(
                os.path.realpath, found
            ):
                found.append(d)
    return found


def extension_suffixes(pkg_dir: str) -> set[str]:
    """The ABI tags of a package's compiled modules (``.cpython-311-x86_64-linux-gnu.so``)."""
    return {m.group(1) for f in os.listdir(pkg_dir) if (m := re.match(r"[^.]+(\..+\.so)$", f))}


def verbs_versions(path: str) -> set[str]:
    """``IBVERBS_*`` symbol versions named in an ELF file (needed by pyverbs, defined by libibverbs)."""
    with open(path, "rb") as f:
        return {m.decode() for m in _VERSION_RE.findall(f.read())}


def pyverbs_needs(pkg_dir: str) -> set[str]:
    need: set[str] = set()
    for so in glob.glob(os.path.join(pkg_dir, "*.so")):
        need |= verbs_versions(so)
    return need


def rdma_core_version(libibverbs: str) -> str:
    """``libibverbs.so.1.14.44.0`` -> ``44.0`` (rdma-core names its library after its release)."""
    m = re.search(r"libibverbs\.so\.\d+\.\d+\.(\d+\.\d+)$", os.path.realpath(libibverbs))
    return m.group(1) if m else "unknown"


def install_hint(os_release: str = "/etc/os-release") -> str:
    """The command that installs the distribution's pyverbs, by /etc/os-release."""
    ids = ""
    try:
        with open(os_release) as f:
            info = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
        ids = f"{info.get('ID', '')} {info.get('ID_LIKE', '')}".replace('"', "")
    except OSError:
        pass
    if re.search(r"\b(debian|ubuntu)\b", ids):
        return "apt-get install python3-pyverbs rdma-core ibverbs-providers"
    if re.search(r"\b(fedora|rhel|centos|rocky|almalinux)\b", ids):
        return "dnf install python3-pyverbs rdma-core libibverbs"
    if re.search(r"\bsuse\b", ids):
        return "zypper install python3-pyverbs rdma-core"
    return "install your distribution's python3-pyverbs (rdma-core's Python bindings)"


# ------------------------------------------------------------------ probing an interpreter
_PROBE = r"""
import importlib.util, json, sys
out = {}
try:
    spec = importlib.util.find_spec("pyverbs")
    out["found"] = spec.origin if spec else ""
except Exception:
    out["found"] = ""
try:
    import pyverbs, pyverbs.device as device
    out["file"] = pyverbs.__file__
    try:
        out["devices"] = [d.name.decode() if isinstance(d.name, bytes) else d.name for d in device.get_device_list()]
    except Exception as e:  # pyverbs raises "Failed to get devices list" where there is none
        out["devices"] = []
        out["device_error"] = str(e)
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
libs = set()
with open("/proc/self/maps") as f:
    for line in f:
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if "/libibverbs.so" in path:
            libs.add(path)
out["libibverbs"] = sorted(libs)
print(json.dumps(out))
"""


def probe(python: str = sys.executable) -> dict:
    """Imports pyverbs in a fresh ``python`` and reports what it loaded (never raises for a failed import)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=PROBE_TIMEOUT_S)
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": f"probe failed: {(res.stderr.strip().splitlines() or ['?'])[-1]}", "libibverbs": []}


def _python_output(python: str, code: str) -> str:
    """What ``python -c code`` prints (stripped)."""
    return subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def _purelib(python: str) -> str:
    if python == sys.executable:
        return sysconfig.get_paths()["purelib"]
    return _python_output(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])")


def _ext_suffix(python: str) -> str:
    if python == sys.executable:
        return sysconfig.get_config_var("EXT_SUFFIX")
    return _python_output(python, "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")


def check_pyverbs(python: str = sys.executable, info: dict | None = None) -> Finding:
    """Is a pyverbs that matches this host's rdma-core importable from ``python``?"""
    info = probe(python) if info is None else info
    problem = pyverbs_problem(info)
    if problem is None:
        pkg = os.path.dirname(os.path.realpath(info["file"]))
        lib = info["libibverbs"][0]
        devices = info.get("devices") or []
        return Finding(
            "pyverbs",
            "ok",
            f"{pkg} (rdma-core {rdma_core_version(lib)}, {lib}); devices: {', '.join(devices) if devices else 'none'}",
        )
    if "error" in info:
        fix = (
            "run `tableserver doctor --fix-pyverbs`"
            if system_pyverbs_dirs()
            else f"{install_hint()}, then run `tableserver doctor --fix-pyverbs`"
        )
        return Finding("pyverbs", "warn", f"not importable ({problem}); only the rdma transport needs it: {fix}")
    return Finding(
        "pyverbs", "FAIL", f"{problem}: remove it (pip uninstall pyverbs) and run `tableserver doctor --fix-pyverbs`"
    )


def pyverbs_problem(info: dict) -> str | None:
    """Why the pyverbs a probe found does not work with this host (None when it does)."""
    if "error" in info:
        return info["error"]
    pkg = os.path.dirname(os.path.realpath(info["file"]))
    libs = info.get("libibverbs") or []
    if not libs:
        return f"{pkg} imported but loaded no libibverbs"
    missing = sorted(pyverbs_needs(pkg) - verbs_versions(os.path.realpath(libs[0])))
    if missing:
        return (
            f"{pkg} needs {', '.join(missing)}, which this host's libibverbs (rdma-core "
            f"{rdma_core_version(libs[0])}) lacks"
        )
    return None


def check_rdma_devices(required: bool = False) -> Finding:
    devices = sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else []
    if devices:
        return Finding("rdma devices", "ok", ", ".join(devices))
    if required:
        return Finding(
            "rdma devices",
            "FAIL",
            "none, but --transports names rdma: load the NIC's driver (and on "
            "Kubernetes request the RDMA device plugin's resource), or drop rdma from --transports",
        )
    return Finding(
        "rdma devices",
        "warn",
        "none (no RDMA NIC, or no Soft-RoCE link: `rdma link add rxe0 type rxe netdev eth0`); tcp and shm still work",
    )


# ------------------------------------------------------------------ the fix
def fix_pyverbs(python: str = sys.executable, source: str | None = None) -> Finding:
    """Makes the host's pyverbs importable from ``python``'s environment and proves it; raises DoctorError."""
    info = probe(python)
    current = check_pyverbs(python, info)
    purelib = _purelib(python)
    link_dir = os.path.join(os.path.dirname(os.path.dirname(purelib)), LINK_DIR_NAME)
    if current.status == "ok" and source is None:
        return Finding("pyverbs", "ok", "already importable: " + current.message)
    shadow = os.path.dirname(info.get("found") or "")
    if shadow and not _same_or_under(shadow, link_dir) and (source is not None or current.status != "ok"):
        # another pyverbs (pip's, built for another rdma-core) comes first on sys.path: a link would not help
        why = pyverbs_problem(info) or "it is found first"
        raise DoctorError(
            f"the pyverbs at {shadow} comes first on this environment's path ({why}): remove it "
            "(pip uninstall pyverbs), then run `tableserver doctor --fix-pyverbs` again"
        )
    if source is not None:
        source = os.path.abspath(source)
        if not os.path.isfile(os.path.join(source, "__init__.py")):
            raise DoctorError(
                f"--pyverbs-from {source}: not a pyverbs package directory (it has no __init__.py): "
                "pass the directory that holds pyverbs' __init__.py"
            )
        candidates = [source]
    else:
        candidates = system_pyverbs_dirs()
        if not candidates:
            raise DoctorError(
                f"this host has no distribution pyverbs: {install_hint()}, then run "
                "`tableserver doctor --fix-pyverbs` again"
            )
    suffix = _ext_suffix(python)
    fitting = [d for d in candidates if suffix in extension_suffixes(d)]
    if not fitting:
        built = ", ".join(
            f"{d} ({' '.join(sorted(extension_suffixes(d))) or 'no compiled modules'})" for d in candidates
        )
        raise DoctorError(
            f"no pyverbs here is built for this Python ({suffix}): {built}; make the environment "
            f"with the Python those were built for (e.g. /usr/bin/python3 -m venv)"
        )
    undo = link(fitting[0], purelib, link_dir)
    info = probe(python)
    after = check_pyverbs(python, info)
    if after.status != "ok":
        undo()  # leave the environment as it was
        raise DoctorError(f"linked {fitting[0]} into {purelib}, but it does not work: {after.message}")
    if os.path.realpath(os.path.dirname(info["file"])) != os.path.realpath(fitting[0]):
        undo()
        raise DoctorError(
            f"linked {fitting[0]}, but this environment still imports {info['file']}: remove that "
            "one (pip uninstall pyverbs) and run again"
        )
    return Finding(
        "pyverbs", "ok", f"linked into {os.path.dirname(os.path.dirname(os.path.dirname(purelib)))}: " + after.message
    )


def _same_or_under(path: str, top: str) -> bool:
    path, top = os.path.abspath(path), os.path.abspath(top)
    return path == top or path.startswith(top + os.sep)


def link(pkg_dir: str, purelib: str, link_dir: str):
    """A directory holding only a ``pyverbs`` symlink to ``pkg_dir``, on ``sys.path`` via a .pth file.

    Returns a function that puts back what was there before.
    """
    target, pth = os.path.join(link_dir, "pyverbs"), os.path.join(purelib, PTH_NAME)
    old_target = os.readlink(target) if os.path.islink(target) else None
    had_pth = os.path.exists(pth)
    try:
        os.makedirs(link_dir, exist_ok=True)
        _symlink_atomic(pkg_dir, target)
        write_atomic(pth, link_dir + "\n")  # O_EXCL|O_NOFOLLOW temp: a planted symlink is not followed
    except OSError as e:
        raise DoctorError(
            f"cannot link pyverbs into {purelib} ({e.strerror}): run it in a virtual environment you can write to"
        ) from None

    def undo() -> None:
        if old_target is None:
            os.unlink(target)
        else:
            _symlink_atomic(old_target, target)
        if not had_pth:
            os.unlink(pth)

    return undo


def _symlink_atomic(source: str, path: str) -> None:
    """Points the symlink ``path`` at ``source``: made under an unpredictable name (symlink() never follows
    or replaces what is there), renamed into place."""
    import secrets

    directory, base = os.path.split(os.path.abspath(path))
    for _ in range(100):
        tmp = os.path.join(directory, f".{base}.{secrets.token_hex(8)}.tmp")
        try:
            os.symlink(source, tmp)
        except FileExistsError:
            continue
        try:
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return
    raise DoctorError(f"cannot create a temporary link next to {path}")


def check_native_take() -> Finding:
    """Whether the native row gather (``tableserver.common._take``, tableserver/common/take.py) was built and loads (it
    needs nothing but Python itself, as the doctor does)."""
    import importlib
    import importlib.util

    fix = "install a C compiler and Python's headers (Debian: apt install gcc python3-dev), then reinstall tableserver"
    if importlib.util.find_spec("tableserver.common._take") is None:
        return Finding(
            "native take",
            "warn",
            f"not built: gathers run numpy's take (slower on random rows: the native one prefetches); {fix}",
        )
    try:
        importlib.import_module("tableserver.common._take")
    except ImportError as e:
        return Finding("native take", "warn", f"built but does not load ({e}): gathers run numpy's take; {fix}")
    if os.environ.get("TABLESERVER_NATIVE_TAKE", "1") == "0":
        return Finding("native take", "warn", "built but off (TABLESERVER_NATIVE_TAKE=0): unset it to use it")
    return Finding("native take", "ok", "tableserver.common._take: bounds-checked, prefetching row gather")


def run(fix_pyverbs_: bool = False, pyverbs_from: str | None = None, out=sys.stdout, cfg: dict | None = None) -> int:
    """The ``doctor`` command: prints one line per check; 1 when a check fails. With a serve configuration
    (``cfg``: the same flags, environment and --config as ``serve``) it also checks what that server needs."""
    if fix_pyverbs_ or pyverbs_from:
        print(fix_pyverbs(source=pyverbs_from).line(), file=out)
        return 0
    wants_rdma = bool(cfg) and "rdma" in cfg.get("transports", [])
    findings = [check_pyverbs(), check_rdma_devices(required=wants_rdma), check_native_take()]
    if cfg is not None:
        findings += host_checks.run(cfg, rdma=wants_rdma or (bool(cfg) and "auto" in cfg.get("transports", [])))
    for f in findings:
        print(f.line(), file=out)
    return 1 if failed(findings) else 0
