"""Run commands on a real verbs stack: kernel Soft-RoCE (rdma_rxe) in a QEMU guest.

These machines have no RDMA NIC and no RDMA in the host kernel, and their KVM
is paravirtual (a stock kernel hangs under it), so the RDMA suite runs in a
QEMU guest under TCG with Debian's kernel:

* a tiny initramfs (busybox + the virtio/9p modules of the installed kernel)
  mounts the host's ``/`` read-only over 9p and chroots into it, so the guest
  runs the very same checkout and virtual environment;
* ``/run`` is a tmpfs in the guest (``TMPDIR`` and ``HOME`` point into it; the
  host's ``/tmp`` stays visible, read-only, since a checkout may live there);
  a second, writable 9p share carries the command in and the exit code and logs out;
* the initramfs' ``/sbin/modprobe`` forwards into the chroot, so the kernel
  can load rdma_rxe's dependencies (crc32) from the host's module tree;
* in the guest: ``modprobe rdma_rxe ib_uverbs``, ``rdma link add rxe_lo type
  rxe netdev lo`` (GID index 1 is the IPv4-mapped 127.0.0.1);
* block devices for fault tests (tests/rdma/test_disk_eio.py): the initramfs
  also loads dm-mod (its ``linear`` and ``error`` targets are built in) and
  loop, so ``/dev/mapper/control`` and ``/dev/loop-control`` exist from boot;
  ``dmsetup`` and ``losetup`` are the host's own binaries (the chroot is the
  host's ``/``, libraries included). There is no udev in the guest: create
  devices with ``DM_DISABLE_UDEV=1 dmsetup create --noudevsync`` (libdevmapper
  then makes the ``/dev/mapper`` nodes itself; :func:`dm_create` does this).

Soft-RoCE under TCG moves ~7.5k READs/s: correctness and same-run ratios
only, never absolute speed. Usage from the command line::

    python tests/rdma/vm.py [--install] -- 'ibv_devices; rdma link'

The command runs in the current directory, and ``python`` in it is the Python that runs vm.py (its
directory, a venv's ``bin``, leads the guest's PATH).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from tableserver.ops.doctor import fix_pyverbs

DEBIAN_PACKAGES = (
    "qemu-system-x86",
    "linux-image-amd64",
    "busybox-static",
    "rdma-core",
    "ibverbs-providers",
    "ibverbs-utils",
    "perftest",
    "python3-pyverbs",
    "iproute2",
    "kmod",
    "cpio",
    "dmsetup",
)
# What the initramfs must provide: the virtio PCI transport, 9p over virtio, the 9p file system. Their
# dependencies, and the order to load them in, come from the installed kernel's own modules.dep.
INITRAMFS_ROOTS = ("virtio_pci", "9pnet_virtio", "9p")
#: Block devices for the guest's fault tests (a dm ``error`` target over part of a loop device): loaded by the
#: initramfs too, after the 9p root's modules. Built-in where the kernel has them built in (nothing to load).
BLOCK_ROOTS = ("dm_mod", "loop")
DEBIAN_PYVERBS = "/usr/lib/python3/dist-packages/pyverbs"
#: the guest's PATH (root's): where it finds the host's tools, sbin included
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
QEMU = "qemu-system-x86_64"
#: the guest's whole console (boot, the command's output), a file in the work directory beside results/
CONSOLE_LOG = "console.log"
#: dmsetup, losetup, blockdev in the guest finish in well under a second; under TCG on a busy host a suspend
#: waiting for reads in flight can take seconds: this only catches a hang
BLOCK_TOOL_TIMEOUT_S = 600
#: the console pipe ends once QEMU has exited; a busy host may take a while to run the reader that drains it
CONSOLE_DRAIN_S = 600
#: The guest kernel's command line. ``init_on_alloc=0``: Debian's kernel zeroes every page it allocates (a
#: hardening default) and user space gets zeroed pages anyway; under TCG that zeroing is slow, and it is all of
#: reserving hugepages: 2200 of 2 MiB (tests/rdma/test_rdma.py's 4 GiB table) took 25 s of the guest, 0.1 s without.
KERNEL_ARGS = "console=ttyS0 quiet loglevel=3 panic=-1 init_on_alloc=0"


class GuestUnavailable(RuntimeError):
    """Something needed to boot the guest is missing (the message says what)."""


class GuestBootFailed(RuntimeError):
    """The guest started but could not reach the command (a module or a 9p mount failed)."""


@dataclass
class GuestResult:
    rc: int
    console: str
    results: str  # host directory the guest wrote into (gone after a clean run in a work directory of its own)
    seconds: float
    console_log: str = ""  # the whole console, as a file (CONSOLE_LOG in the work directory)


def _version_key(version: str) -> list:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[.\-+~]", version)]


def kernel_version() -> str | None:
    """The newest installed kernel whose module tree has rdma_rxe (None when there is none)."""
    versions = [k.split("vmlinuz-", 1)[1] for k in glob.glob("/boot/vmlinuz-*")]
    for version in sorted(versions, key=_version_key, reverse=True):
        if os.path.isdir(f"/lib/modules/{version}/kernel/drivers/infiniband/sw/rxe"):
            return version
    return None


def _module_name(path: str) -> str:
    """``kernel/fs/9p/9p.ko.xz`` -> ``9p`` (module names treat - and _ alike)."""
    return os.path.basename(path).split(".ko", 1)[0].replace("-", "_")


def read_modules_dep(version: str, modules_dir: str = "/lib/modules") -> tuple[dict, dict, set]:
    """The kernel's own module graph: (name -> deps, name -> .ko path, built-in names)."""
    base = os.path.join(modules_dir, version)
    deps, paths = {}, {}
    with open(os.path.join(base, "modules.dep")) as f:
        for line in f:
            if ":" not in line:
                continue
            mod, rest = line.split(":", 1)
            name = _module_name(mod)
            paths[name] = os.path.join(base, mod)
            deps[name] = [_module_name(d) for d in rest.split()]
    builtin = set()
    try:
        with open(os.path.join(base, "modules.builtin")) as f:
            builtin = {_module_name(line.strip()) for line in f if line.strip()}
    except FileNotFoundError:
        pass
    return deps, paths, builtin


def module_load_order(version: str, roots=INITRAMFS_ROOTS, modules_dir: str = "/lib/modules") -> list[tuple[str, str]]:
    """``[(name, ko_path)]`` for ``roots`` and everything they depend on, each after its dependencies.

    Built-in modules are left out (nothing to load). Raises GuestUnavailable
    naming the module when the kernel has neither the module nor a built-in.
    """
    deps, paths, builtin = read_modules_dep(version, modules_dir)
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, wanted_by: str) -> None:
        if state.get(name) == "done" or name in builtin and name not in paths:
            return
        if name not in paths:
            raise GuestUnavailable(
                f"kernel {version} has no module {name} (needed by {wanted_by}): install a kernel with "
                f"9p over virtio, device-mapper and loop, e.g. linux-image-amd64"
            )
        if state.get(name) == "visiting":
            raise GuestUnavailable(f"kernel {version}: modules.dep has a dependency cycle through {name}")
        state[name] = "visiting"
        for dep in deps[name]:
            visit(dep, name)
        state[name] = "done"
        order.append(name)

    for root in roots:
        name = root.replace("-", "_")
        visit(name, "the guest's block-device tests" if name in BLOCK_ROOTS else "the guest's 9p root")
    return [(name, paths[name]) for name in order]


def missing() -> list[str]:
    """What this host lacks to run the RDMA suite (empty when ready)."""
    need = []
    if shutil.which(QEMU) is None:
        need.append("qemu-system-x86")
    if kernel_version() is None:
        need.append("linux-image-amd64 (a kernel with rdma_rxe)")
    if not os.path.exists("/bin/busybox") or "static" not in _file_kind("/bin/busybox"):
        need.append("busybox-static")
    if not os.path.isdir(DEBIAN_PYVERBS):
        need.append("python3-pyverbs")
    for tool, pkg in (
        ("ibv_devices", "ibverbs-utils"),
        ("ib_read_bw", "perftest"),
        ("rdma", "iproute2"),
        ("cpio", "cpio"),
        ("modprobe", "kmod"),
        ("dmsetup", "dmsetup"),
        ("losetup", "mount (losetup)"),
    ):
        if shutil.which(tool, path=GUEST_PATH) is None:
            need.append(pkg)
    if not glob.glob("/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so"):
        need.append("ibverbs-providers")
    return need


def _file_kind(path: str) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
        return "static" if b"/lib64/ld-linux" not in head and b"ld-linux" not in head else "dynamic"
    except OSError:
        return ""


def ensure_host_packages(install: bool = True) -> None:
    """Installs the Debian packages the guest needs (as root); raises GuestUnavailable otherwise."""
    need = missing()
    if not need:
        return
    if not install or os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise GuestUnavailable(
            f"Soft-RoCE guest needs: {', '.join(need)} (install as root: apt-get install {' '.join(DEBIAN_PACKAGES)})"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *DEBIAN_PACKAGES],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    still = missing()
    if still:
        raise GuestUnavailable(f"installed the packages but still missing: {', '.join(still)}")


_INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in __MODULES__; do
  err=$(insmod /lib/modules/$m.ko 2>&1) || { echo "GUEST: insmod $m failed: $err"; poweroff -f; }
done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=1048576,cache=loose hostroot /mnt || { echo "GUEST: 9p root failed"; poweroff -f; }
mount -t tmpfs -o size=75% run /mnt/run
mkdir -p /mnt/run/tmp
R=$(cat /proc/cmdline | sed -n 's/.*tsresults=\([^ ]*\).*/\1/p')
mkdir -p /mnt$R 2>/dev/null
mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576 results /mnt$R || { echo "GUEST: 9p results failed"; poweroff -f; }
mount --bind /dev /mnt/dev
mkdir -p /dev/shm /dev/pts
mount -t tmpfs shm /mnt/dev/shm
mount -t devpts devpts /mnt/dev/pts 2>/dev/null
mount -t proc proc /mnt/proc
mount -t sysfs sys /mnt/sys
echo /sbin/modprobe > /proc/sys/kernel/modprobe
echo "GUEST: up in $(cut -d' ' -f1 /proc/uptime) s"
chroot /mnt /bin/sh -c "cd / && . $R/env.sh && /bin/sh $R/cmd.sh" > /dev/console 2>&1
echo $? > /mnt$R/rc
sync
echo "GUEST: done in $(cut -d' ' -f1 /proc/uptime) s"
poweroff -f
"""

_MODPROBE = """#!/bin/busybox sh
exec /bin/busybox chroot /mnt /sbin/modprobe "$@"
"""


def build_initramfs(path: str, version: str) -> str:
    """A gzipped newc cpio: busybox, the 9p/virtio modules, /init, forwarding modprobe."""
    root = tempfile.mkdtemp(prefix="ts-initramfs-")
    try:
        for d in ("bin", "sbin", "proc", "sys", "dev", "mnt", "lib/modules"):
            os.makedirs(os.path.join(root, d))
        shutil.copy2("/bin/busybox", os.path.join(root, "bin", "busybox"))
        order = module_load_order(version, INITRAMFS_ROOTS + BLOCK_ROOTS)
        for m, src in order:
            dst = os.path.join(root, "lib", "modules", f"{m}.ko")
            if src.endswith(".xz"):
                import lzma

                with lzma.open(src) as fi, open(dst, "wb") as fo:
                    shutil.copyfileobj(fi, fo)
            elif src.endswith(".zst"):
                subprocess.run(["zstd", "-dq", src, "-o", dst], check=True)
            else:
                shutil.copy2(src, dst)
        modules = " ".join(m for m, _ in order)
        for name, text in (("init", _INIT.replace("__MODULES__", modules)), ("sbin/modprobe", _MODPROBE)):
            p = os.path.join(root, name)
            with open(p, "w") as f:
                f.write(text)
            os.chmod(p, 0o755)
        cpio = subprocess.run(
            "find . | cpio -o -H newc --quiet", shell=True, cwd=root, check=True, capture_output=True
        ).stdout
        with gzip.open(path, "wb", compresslevel=1) as f:
            f.write(cpio)
        return path
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_guest(
    script: str,
    *,
    workdir: str | None = None,
    timeout: float = 1800,
    memory_mb: int = 6144,
    cpus: int = 2,
    env: dict | None = None,
    echo: bool = False,
) -> GuestResult:
    """Boots the guest, runs ``script`` (sh) in the chroot, returns its exit code and console.

    Without ``workdir`` it makes one in TMPDIR and removes it after a clean exit (rc 0); after a failure it
    stays (the console and the results named in the error or the result), for a person to read."""
    ensure_host_packages(install=os.geteuid() == 0)
    version = kernel_version()
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="ts-guest-")
    results = os.path.join(workdir, "results")
    os.makedirs(results, exist_ok=True)
    os.chmod(results, 0o777)
    initrd = os.path.join(workdir, "initramfs.cpio.gz")
    if not os.path.exists(initrd):
        build_initramfs(initrd, version)
    with open(os.path.join(results, "cmd.sh"), "w") as f:
        f.write("set -u\n" + script + "\n")
    # The host's / (with /tmp, where a checkout may live) is read-only in the guest; scratch space is
    # a tmpfs under /run.
    base_env = {
        "PATH": GUEST_PATH,
        "HOME": "/run/tmp",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "TMPDIR": "/run/tmp",
        "TABLESERVER_IN_GUEST": "1",
        "TABLESERVER_GUEST_RESULTS": results,
        "LANG": "C.UTF-8",
    }
    base_env.update(env or {})
    with open(os.path.join(results, "env.sh"), "w") as f:
        for k, v in base_env.items():
            f.write(f"export {k}='{v}'\n")
    rc_file = os.path.join(results, "rc")
    if os.path.exists(rc_file):
        os.unlink(rc_file)
    cmd = [
        QEMU,
        "-accel",
        "tcg,thread=multi",
        "-cpu",
        "max",
        "-smp",
        str(cpus),
        "-m",
        str(memory_mb),
        "-nographic",
        "-no-reboot",
        "-net",
        "none",
        "-kernel",
        f"/boot/vmlinuz-{version}",
        "-initrd",
        initrd,
        "-append",
        f"{KERNEL_ARGS} tsresults={results}",
        "-virtfs",
        "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        "-virtfs",
        f"local,path={results},mount_tag=results,security_model=none,multidevs=remap",
    ]
    start = time.monotonic()
    console = io.StringIO()
    console_log = os.path.join(workdir, CONSOLE_LOG)  # beside results/, which the guest writes into
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace"
    )

    def pump():
        with open(console_log, "w") as log:  # line by line: a guest that hangs or is killed leaves it all here
            for line in proc.stdout:
                console.write(line)
                log.write(line)
                log.flush()
                if echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()

    import threading

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(CONSOLE_DRAIN_S)
        raise TimeoutError(
            f"guest did not finish in {timeout:.0f} s (whole console: {console_log}); console tail:\n"
            f"{console.getvalue()[-8000:]}"
        ) from None
    reader.join(CONSOLE_DRAIN_S)  # the rest of the console (the test summary) is still in the pipe
    try:
        with open(rc_file) as f:
            rc = int(f.read().strip() or 1)
    except (OSError, ValueError):
        failed = [ln.strip() for ln in console.getvalue().splitlines() if ln.startswith("GUEST:") and "failed" in ln]
        if failed:  # the boot itself failed: say where, in one line
            raise GuestBootFailed(f"Soft-RoCE guest (kernel {version}) did not boot: {failed[0][7:]}") from None
        rc = 255  # the guest never reached the end of the script
    if own and rc == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    return GuestResult(rc, console.getvalue(), results, time.monotonic() - start, console_log)


# -- block devices, in the guest (root, no udev) -----------------------------------------------------


def _block_tool(*args: str, env: dict | None = None, stdin: str | None = None) -> str:
    res = subprocess.run(args, input=stdin, capture_output=True, text=True, env=env, timeout=BLOCK_TOOL_TIMEOUT_S)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({res.returncode}): {(res.stderr or res.stdout).strip()}")
    return res.stdout.strip()


def loop_attach(path: str, read_only: bool = True) -> str:
    """Attaches ``path`` to a free loop device (read-only by default) and returns the device's path."""
    return _block_tool("losetup", "--find", "--show", *(["--read-only"] if read_only else []), path)


def loop_detach(device: str) -> None:
    _block_tool("losetup", "--detach", device)


def sectors(device: str) -> int:
    """Size of a block device in 512-byte sectors."""
    return int(_block_tool("blockdev", "--getsz", device))


def _dm_env() -> dict:
    """libdevmapper without udev: it creates and removes the /dev/mapper nodes itself."""
    return dict(os.environ, DM_DISABLE_UDEV="1")


def dm_create(name: str, table: list[str], read_only: bool = True) -> str:
    """A device-mapper device ``name`` from ``table`` (lines ``start length target args``, in sectors);
    returns ``/dev/mapper/<name>`` once the node exists. There is no udev here: the node is made by
    libdevmapper (``DM_DISABLE_UDEV``) and, should that not have happened, by ``dmsetup mknodes``."""
    if not os.path.exists("/dev/mapper/control"):
        subprocess.run(["modprobe", "dm_mod"], capture_output=True)
    ro = ["--readonly"] if read_only else []
    _block_tool("dmsetup", "create", name, "--noudevsync", *ro, env=_dm_env(), stdin="".join(f"{t}\n" for t in table))
    node = f"/dev/mapper/{name}"
    if not os.path.exists(node):
        _block_tool("dmsetup", "mknodes", name, env=_dm_env())
    if not os.path.exists(node):
        raise RuntimeError(f"dmsetup created {name} but no {node} appeared (udev-less node creation failed)")
    return node


def dm_reload(name: str, table: list[str]) -> None:
    """Swaps ``name``'s table for ``table`` under whoever has it open (suspend, reload, resume): a drive
    that starts failing, or heals, while it is read."""
    _block_tool("dmsetup", "suspend", "--noudevsync", name, env=_dm_env())
    try:
        _block_tool("dmsetup", "reload", name, env=_dm_env(), stdin="".join(f"{t}\n" for t in table))
    finally:
        _block_tool("dmsetup", "resume", "--noudevsync", name, env=_dm_env())


def dm_remove(name: str) -> None:
    _block_tool("dmsetup", "remove", "--noudevsync", name, env=_dm_env())


def dm_table(name: str) -> str:
    return _block_tool("dmsetup", "table", name, env=_dm_env())


RXE_SETUP = """
modprobe rdma_rxe && modprobe ib_uverbs || exit 90
ip link set lo up
rdma link add rxe_lo type rxe netdev lo || exit 91
"""


def main() -> int:
    ap = argparse.ArgumentParser(description="run a shell command in the Soft-RoCE QEMU guest")
    ap.add_argument("--install", action="store_true", help="apt-get install what is missing (root)")
    ap.add_argument("--no-rxe", action="store_true", help="do not create the rxe_lo device first")
    ap.add_argument("--memory", type=int, default=6144, help="guest memory in MiB")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    ensure_host_packages(install=args.install)
    print(fix_pyverbs().line())  # `tableserver doctor --fix-pyverbs`: the host's pyverbs in this venv
    command = " ".join(args.command[1:] if args.command[:1] == ["--"] else args.command) or "ibv_devinfo"
    res = run_guest(
        ("" if args.no_rxe else RXE_SETUP) + f"cd {os.getcwd()}\n" + command,
        echo=True,
        memory_mb=args.memory,
        timeout=args.timeout,
        env={"PATH": f"{os.path.dirname(sys.executable)}:{GUEST_PATH}"},  # `python` there: the one running this
    )
    print(f"\n[guest exit {res.rc} after {res.seconds:.1f} s]")
    return res.rc


if __name__ == "__main__":
    sys.exit(main())
