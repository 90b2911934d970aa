"""The committed gRPC stubs are exactly what the pinned generator makes from the .proto."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT

STUBS = ["tableserver_pb2.py", "tableserver_pb2_grpc.py", "tableserver_pb2.pyi"]


def test_generated_stubs_match_proto(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            "proto",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            "proto/tableserver/v1/tableserver.proto",
        ],
        check=True,
        cwd=ROOT,
    )
    for name in STUBS:
        with open(os.path.join(tmp_path, "tableserver", "v1", name)) as f:
            fresh = f.read()
        with open(os.path.join(ROOT, "tableserver", "v1", name)) as f:
            committed = f.read()
        assert committed == fresh, f"tableserver/v1/{name} drifted from the .proto: run `make proto` and commit"
