"""A Ray head started apart, as verl_stage.sbatch starts one (`ray start --head --block`, every port
explicit), on ports free on this machine, and stopped with everything it started however the test
ends. For the tests that need a Ray cluster but no Slurm."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch.local import free_port

RAY = [sys.executable, "-m", "ray.scripts.scripts"]


@contextlib.contextmanager
def ray_head_apart(env: dict[str, str], num_cpus: int = 1, num_gpus: int = 0, ready_s: float = 180):
    """The head's address, once `ray status` answers it with `env` (the template's poll)."""
    first = free_port()
    workers = range(first, first + 21)

    def port_outside_workers() -> int:  # Ray refuses a component port inside the worker range
        while (port := free_port()) in workers:
            pass
        return port

    port = port_outside_workers()
    flags = ("node-manager-port", "object-manager-port", "ray-client-server-port", "dashboard-port",
             "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
             "metrics-export-port")  # fmt: skip
    # Ray's unix sockets live under the temp dir, whose path must stay under ~100 characters.
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    log = open(temp_dir / "head.log", "w")
    proc = subprocess.Popen(
        [
            *RAY,
            "start",
            "--head",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus}",
            f"--num-gpus={num_gpus}",
            "--include-dashboard=false",
            *(f"--{flag}={port_outside_workers()}" for flag in flags),
            f"--min-worker-port={workers[0]}",
            f"--max-worker-port={workers[-1]}",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
            "--block",
        ],  # fmt: skip
        env=env,
        start_new_session=True,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    address = f"127.0.0.1:{port}"
    try:
        # A head that answers only with a token the probe does not have never passes.
        deadline = time.monotonic() + ready_s
        status = [*RAY, "status", "--address", address]
        while subprocess.run(status, env=env, capture_output=True).returncode != 0:
            head_log = (temp_dir / "head.log").read_text()[-3000:]
            assert proc.poll() is None and time.monotonic() < deadline, head_log
            time.sleep(1)
        yield address
    finally:  # stopped even when it never came up: a head left running holds its ports
        stop_head(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop_head(proc: subprocess.Popen) -> None:
    """SIGTERM to `ray start` alone (it drains, then stops its GCS and raylet: seconds; signalled all
    at once they wait out a 30 s drain), then SIGKILL to its session for whatever is left."""
    with contextlib.suppress(ProcessLookupError):  # a head that died must not hide its log
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=45)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the head's session: its raylet, GCS and workers
    proc.wait()
