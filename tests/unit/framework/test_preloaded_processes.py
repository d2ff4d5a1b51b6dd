"""Rank processes forked from a preloaded server (mas_async/preloaded_processes.py): a child starts with the
trainer's modules already imported (a spawned interpreter would import them itself), is not a fork of the
caller, and a child that fails raises in the caller as in torch's spawn."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessRaisedException

from mas_async import preloaded_processes
from tests.support.paths import ROOT


def _report(rank: int, caller: int, out: dict) -> None:
    out[rank] = {
        "preloaded": [name for name in preloaded_processes.PRELOAD if name in sys.modules],
        "parent": os.getppid(),
        "caller": caller,
    }


def _fail(rank: int) -> None:
    if rank == 1:
        raise ValueError(f"rank {rank} failed on purpose")


def test_children_start_with_the_preload_imported_and_are_forks_of_the_server() -> None:
    out = mp.Manager().dict()
    preloaded_processes.spawn(_report, (os.getpid(), out), nprocs=2)
    for rank in (0, 1):  # (a spawned child would hold torch only: this module imports nothing else of them)
        assert out[rank]["preloaded"] == list(preloaded_processes.PRELOAD)
        assert out[rank]["parent"] != out[rank]["caller"]  # the server's child, not the caller's
    assert out[0]["parent"] == out[1]["parent"]  # one server for both


def test_a_failing_child_raises_in_the_caller() -> None:
    with pytest.raises(ProcessRaisedException, match="rank 1 failed on purpose"):
        preloaded_processes.spawn(_fail, nprocs=2)


def test_the_preload_queries_no_cuda() -> None:
    """A process forked after a CUDA query cannot use CUDA (torch's `_cuda_getDeviceCount` poisons fork, as
    tests/unit/framework/test_vllm_fork_safety.py fakes): importing the preload, as the server does, makes none.
    Checked in a fresh interpreter, where nothing is imported yet, with the query recorded instead of made."""
    probe = (
        "import sys, torch\n"
        "calls = []\n"
        "torch._C._cuda_getDeviceCount = lambda: calls.append(1) or 0\n"
        "import importlib\n"
        "from mas_async import preloaded_processes\n"
        "for name in preloaded_processes.PRELOAD:\n"
        "    importlib.import_module(name)\n"
        "assert not torch.cuda.is_initialized()\n"
        "print(len(calls))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
