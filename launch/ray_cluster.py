"""Waiting until the Ray cluster of a verl job is whole: every node of the allocation joined, with
its GPUs. Polls the cluster's own node table (no fixed sleeps), with a deadline and a message that
says what is missing. Run by slurm/templates/verl_stage.sbatch:

    python -m launch.ray_cluster ADDRESS NODES GPUS_PER_NODE TIMEOUT_S
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time

# The srun steps that hold this job's Ray nodes (verl_stage.sbatch names them): children of the driver,
# which the batch shell became by exec.
RAY_STEPS_ENV = "HPCR1_RAY_STEPS"


def auth_env() -> dict[str, str]:
    """Token authentication with a fresh token, for a Ray started apart and everything that joins it,
    as verl_stage.sbatch sets it (why, there): a token in the home then changes nothing."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def gpu_nodes(nodes: list[dict], gpus_per_node: int) -> list[str]:
    """Addresses of the live nodes that offer at least `gpus_per_node` GPUs (ray.nodes() rows)."""
    return [
        n["NodeManagerAddress"] for n in nodes if n["Alive"] and n["Resources"].get("GPU", 0) >= gpus_per_node
    ]


def connect(address: str, deadline: float, poll_s: float) -> None:
    """ray.init, retried until `deadline`: `ray status` answers as soon as the head's GCS is up,
    before its raylet has registered, and a driver started then can fail to find a node."""
    import ray

    while True:
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            return
        except (ConnectionError, RuntimeError) as e:
            ray.shutdown()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"could not connect to the Ray cluster at {address}: {e}") from e
            time.sleep(poll_s)


def wait_for_nodes(
    address: str, want: int, gpus_per_node: int, timeout_s: float, poll_s: float = 2.0
) -> list[str]:
    import ray

    deadline = time.monotonic() + timeout_s
    connect(address, deadline, poll_s)
    try:
        while True:
            ready = gpu_nodes(ray.nodes(), gpus_per_node)
            if len(ready) >= want:
                return ready
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"only {len(ready)} of {want} nodes joined the Ray cluster at {address} with "
                    f"{gpus_per_node} GPU(s) each within {timeout_s:.0f} s (joined: {ready or 'none'})"
                )
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def end_ray_steps(timeout_s: float = 60.0, poll_s: float = 0.2) -> None:
    """Ends the job's Ray steps before the job ends: SIGTERM to their sruns, which cancel the steps and
    wait for them (Ray stops in ~3 s). Left running, a step outlives the batch script with its srun
    killed, and Slurm holds the allocation ~35 s more (KillWait, then a timeout telling srun the tasks
    ended): the next job of the chain, or a requeued one, waits that long for the nodes."""
    pids = [int(pid) for pid in os.environ.get(RAY_STEPS_ENV, "").split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:  # it ended on its own (its node failed, say)
            pass
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG) != (0, 0):
                    break
            except ChildProcessError:  # already reaped, or not ours: nothing to wait for
                break
            time.sleep(poll_s)


def main(argv: list[str]) -> int:
    address, want, gpus, timeout = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    try:
        ready = wait_for_nodes(address, want, gpus, timeout)
    except TimeoutError as e:
        print(f"hpcr1: error: {e}", file=sys.stderr)
        return 1
    print(f"Ray cluster ready: {len(ready)} node(s) with {gpus} GPU(s) each", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
