"""Explicit groups, the torch backend "gpucast", the weight-sync example and mismatches, on
one GPU: every process on GPU 0 (gpucast's shared-device mode), launched separately (plain
subprocesses, none of torchrun's variables). Skipped without torch or a GPU."""

import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import gpucast  # noqa: E402
from procs import SAFE_ENV, collect, free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TORCHRUN_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "GPUCAST_JOB_TOKEN"]


def run_group(case, world, timeout=240, timeout_s="10"):
    port, token = free_port(), gpucast.random_token()
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    procs = []
    for rank in range(world):
        env = dict(base, **SAFE_ENV, CASE=case, RANK_ARG=str(rank), WORLD_ARG=str(world),
                   PORT_ARG=str(port), TOKEN_ARG=token, TIMEOUT_S=timeout_s)
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "group_main.py")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = collect(procs, timeout)
    for rank, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"rank {rank}:\n{err[-4000:]}"
        assert out.startswith(f"ok {case} rank {rank}"), out
    return outs


def test_an_explicit_group_of_separate_processes_broadcasts_a_state_dict():
    run_group("explicit", 3)


@pytest.mark.parametrize("variant", ["shape", "dtype", "count"])
def test_a_state_dict_that_differs_is_an_error_naming_the_tensor_on_every_rank(variant):
    start = time.monotonic()
    outs = run_group(f"explicit-{variant}", 3, timeout_s="5")
    assert time.monotonic() - start < 120
    for _, _, err in outs:
        assert "MismatchError" in err


def test_the_torch_backend_broadcasts_and_refuses_the_rest():
    run_group("backend", 3)


def test_the_torch_backend_reports_a_mismatch_on_every_rank():
    outs = run_group("backend-mismatch", 3, timeout_s="5")
    for _, _, err in outs:
        assert "b.weight" in err


EXAMPLE = os.path.join(HERE, "..", "examples", "rl_weight_sync.py")
if not os.path.exists(EXAMPLE):  # the repository's layout (the GPU staging flattens it)
    EXAMPLE = os.path.join(HERE, "..", "..", "examples", "python", "rl_weight_sync.py")


def run_example(*args, timeout=400):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    p = subprocess.run([sys.executable, EXAMPLE, *args], env=dict(env, **SAFE_ENV),
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("door", ["explicit", "torch"])
def test_the_weight_sync_example_checks_every_tensor(door):
    rc, out = run_example("--workers", "2", "--size", "64M", "--steps", "2", "--door", door)
    assert rc == 0, out[-6000:]
    assert out.count("checked bit for bit") == 3, out[-6000:]
    assert "gpucast, one fused call" in out


def test_the_weight_sync_example_reports_a_mismatch_on_every_process():
    rc, out = run_example("--workers", "2", "--size", "16M", "--mismatch", "--timeout", "5")
    assert rc == 0, out[-6000:]
    assert out.count("MismatchError after") == 3, out[-6000:]
