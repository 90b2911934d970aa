"""The Soft-RoCE guest's initramfs loads its modules in an order computed from the kernel itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "rdma"))
import vm  # noqa: E402


def test_order_is_dependency_closed_for_the_installed_kernel():
    """Checked against ``modinfo -F depends``, a second reading of the same kernel than modules.dep."""
    version = vm.kernel_version()
    if version is None or shutil.which("modinfo") is None:
        pytest.skip("no kernel with rdma_rxe (or no modinfo) installed: install linux-image-amd64 and kmod")
    order = vm.module_load_order(version)
    names = [name for name, _ in order]
    assert len(names) == len(set(names)), names
    _, _, builtin = vm.read_modules_dep(version)
    for root in vm.INITRAMFS_ROOTS:
        assert root in names or root in builtin, f"{root} neither loaded nor built in ({names})"
    for i, (name, path) in enumerate(order):
        assert os.path.exists(path), path
        depends = subprocess.run(
            ["modinfo", "-k", version, "-F", "depends", name], capture_output=True, text=True, check=True
        ).stdout.strip()
        for dep in filter(None, depends.replace("-", "_").split(",")):
            assert dep in names[:i] or dep in builtin, f"{name} is loaded before its dependency {dep}: {names}"


def _fake_kernel(tmp_path, dep_lines: list[str], builtin: list[str] = ()) -> str:
    base = tmp_path / "6.99.0-test"
    base.mkdir()
    (base / "modules.dep").write_text("\n".join(dep_lines) + "\n")
    (base / "modules.builtin").write_text("".join(f"kernel/{b}.ko\n" for b in builtin))
    return str(tmp_path)


def test_order_follows_the_graph_not_the_listing(tmp_path):
    modules = _fake_kernel(
        tmp_path,
        [
            "kernel/virtio/virtio.ko.xz: kernel/virtio/virtio_ring.ko.xz",
            "kernel/virtio/virtio_pci.ko.xz: kernel/virtio/virtio.ko.xz kernel/virtio/virtio_ring.ko.xz",
            "kernel/virtio/virtio_ring.ko.xz:",
            "kernel/net/9pnet_virtio.ko.xz: kernel/net/9pnet.ko.xz kernel/virtio/virtio.ko.xz",
            "kernel/net/9pnet.ko.xz:",
            "kernel/fs/9p.ko.xz: kernel/net/9pnet.ko.xz kernel/fs/net-fs.ko.xz",
        ],
        builtin=["fs/net-fs"],
    )  # a dependency built into this kernel: nothing to load
    order = [name for name, _ in vm.module_load_order("6.99.0-test", modules_dir=modules)]
    assert order == ["virtio_ring", "virtio", "virtio_pci", "9pnet", "9pnet_virtio", "9p"]


def test_missing_module_is_named(tmp_path):
    modules = _fake_kernel(
        tmp_path, ["kernel/virtio_pci.ko: kernel/virtio.ko", "kernel/9p.ko:", "kernel/9pnet_virtio.ko:"]
    )
    with pytest.raises(vm.GuestUnavailable, match="no module virtio .needed by virtio_pci"):
        vm.module_load_order("6.99.0-test", modules_dir=modules)


def test_kernel_versions_sort_numerically():
    assert sorted(["6.1.0-9-amd64", "6.1.0-57-amd64", "6.12.1-amd64"], key=vm._version_key) == [
        "6.1.0-9-amd64",
        "6.1.0-57-amd64",
        "6.12.1-amd64",
    ]
