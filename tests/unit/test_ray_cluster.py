"""The readiness check of a verl job's Ray cluster, against a real Ray head started here: it sees
the node join, and when nodes are missing it fails at its deadline saying how many joined."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from core.cluster import RayPorts, ephemeral_ports, load_profile
from core.config import ConfigError
from launch.ray_cluster import auth_env, gpu_nodes
from launch.slurm_launch import rendezvous_port
from tests.conftest import REPO
from tests.ray_head import ray_head_apart


def test_only_live_nodes_with_enough_gpus_count():
    nodes = [
        {"NodeManagerAddress": "a", "Alive": True, "Resources": {"GPU": 4.0}},
        {"NodeManagerAddress": "b", "Alive": False, "Resources": {"GPU": 4.0}},
        {"NodeManagerAddress": "c", "Alive": True, "Resources": {"GPU": 2.0}},
        {"NodeManagerAddress": "d", "Alive": True, "Resources": {"CPU": 8.0}},
    ]
    assert gpu_nodes(nodes, 4) == ["a"] and gpu_nodes(nodes, 0) == ["a", "c", "d"]


STALE_TOKEN = "0123456789abcdef" * 4  # what a Ray started in-process leaves in ~/.ray/auth_token


@pytest.fixture(params=["home without a token", "home with a token"])
def ray_env(request, tmp_path):
    """The environment of a Ray started apart and of what probes it, as verl_stage.sbatch sets it,
    under a temporary home (never the user's): one without a token, or one holding another Ray's."""
    home = tmp_path / "home"
    if request.param == "home with a token":
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text(STALE_TOKEN)
    env = {**os.environ, "HOME": str(home), **auth_env()}
    for name in ("RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        env.pop(name, None)
    return env


@pytest.fixture
def ray_head(ray_env):
    with ray_head_apart(ray_env) as address:
        yield address


@pytest.mark.slow
def test_readiness_sees_the_head_and_times_out_naming_missing_nodes(ray_head, ray_env):
    """Ray started and probed as the template does, whether or not the home holds a token: the
    readiness check (the template's `python -m launch.ray_cluster`) sees the head's node."""
    real_token = Path.home() / ".ray" / "auth_token"
    had_token = real_token.exists()

    def probe(nodes: str, timeout_s: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "launch.ray_cluster", ray_head, nodes, "0", timeout_s],
            env=ray_env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )

    ready = probe("1", "60")
    assert ready.returncode == 0 and "Ray cluster ready: 1 node(s)" in ready.stdout, ready.stderr[-3000:]
    started = time.monotonic()
    short = probe("2", "3")
    assert short.returncode == 1 and "only 1 of 2 nodes joined" in short.stderr, short.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert real_token.exists() == had_token  # nothing was written to the user's home


def test_ray_ports_default_to_distinct_values():
    ports = list(RayPorts().component_ports().values())
    assert len(ports) == 9 and len(set(ports)) == len(ports)


@pytest.mark.parametrize(
    "ports, message",
    [
        (
            {"object_manager_port": 10500},
            "object_manager_port 10500 is inside the worker port range 10002-10999",
        ),
        ({"metrics_export_port": 6380}, "metrics_export_port and node_manager_port are both 6380"),
        (
            {"min_worker_port": 20000, "max_worker_port": 19000},
            "min_worker_port 20000 is above max_worker_port 19000",
        ),
    ],
)
def test_a_profile_with_clashing_ray_ports_is_refused_naming_them(tmp_path, ports, message):
    profile = tmp_path / "site.yaml"
    profile.write_text(yaml.safe_dump({"name": "site", "ray": ports}))
    with pytest.raises(ConfigError, match=f"site.yaml:ray: .*{message}"):
        load_profile(str(profile))


def test_the_default_ray_ports_and_rendezvous_ports_are_outside_the_ephemeral_range():
    """CI lost a verl job to "Address already in use": the metrics port (52368, Ray's own default)
    was held by an outgoing connection when the dashboard agent bound it, and the raylet died with
    the agent. The defaults stay below Linux's default ephemeral range, as does the Slurm jobs'
    rendezvous port for any job id."""
    default_range = range(32768, 61000)
    ports = RayPorts()
    assert not [p for p in [*ports.component_ports().values(), ports.min_worker_port, ports.max_worker_port]
                if p in default_range]  # fmt: skip
    assert max(rendezvous_port(str(job)) for job in range(0, 100_000, 7)) < default_range.start


def test_a_ray_port_in_this_machines_ephemeral_range_is_refused_unless_reserved(tmp_path):
    span, reserved = ephemeral_ports()
    port = next((p for p in span if p not in reserved), None)
    assert port is not None, "no unreserved ephemeral port on this machine: nothing to check"
    profile = tmp_path / "site.yaml"
    profile.write_text(yaml.safe_dump({"name": "site", "ray": {"metrics_export_port": port}}))
    with pytest.raises(ConfigError, match=f"site.yaml:ray: .*metrics_export_port {port} is inside this "
                       f"machine's ephemeral port range {span.start}-{span.stop - 1}"):  # fmt: skip
        load_profile(str(profile))


def test_ephemeral_ports_read_the_range_and_the_reserved_ports(tmp_path):
    (tmp_path / "ip_local_port_range").write_text("32768\t60999\n")
    (tmp_path / "ip_local_reserved_ports").write_text("52365-52368,40000\n")
    span, reserved = ephemeral_ports(tmp_path)
    assert (span.start, span.stop) == (32768, 61000)
    assert reserved == {52365, 52366, 52367, 52368, 40000}
    (tmp_path / "ip_local_reserved_ports").write_text("\n")
    assert ephemeral_ports(tmp_path)[1] == set()
