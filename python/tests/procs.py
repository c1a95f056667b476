"""What the GPU tests that start processes share: the environment every process gets
(NVLink multicast off), a free port on loopback, and collecting the processes' results."""

import socket
import subprocess

# NVLink multicast stays off in every process a test starts.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect(procs, timeout):
    """(returncode, stdout, stderr) of each process, in order; every process is killed when
    one outlasts `timeout` seconds (then the timeout is raised)."""
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    return outs
