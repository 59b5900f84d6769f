"""sbatch scripts rendered for real cluster profiles: the directives and srun line an expert would
write, valid shell (shellcheck), and hostile strings that stay inert."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from core.cluster import load_profile
from launch.sbatch import render_doctor_script, render_stage_script, render_verl_script, sbatch_command
from launch.slurm_launch import run_stage_in_allocation, srun_command
from launch.verl_job import run_then_eval_on_verl
from tests.support.system_packages import system_command

PWNED = Path("/tmp/pwned")


def directives(script: str) -> list[str]:
    return [line.split(None, 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]


@pytest.mark.parametrize("nodes", [1, 2, 32])
def test_perlmutter_script_has_gpu_directives_and_slingshot_env(nodes, tmp_path):
    script = render_stage_script(load_profile("perlmutter"), tmp_path / "run", "stage2_grpo", nodes)
    d = directives(script)
    for expected in (
        f"--nodes={nodes}",
        "--ntasks-per-node=4",
        "--gpus-per-node=4",
        "--constraint=gpu",
        "--qos=regular",
        "--requeue",
        "--signal=B:USR1@600",
        "--exclusive",
    ):
        assert expected in d, (expected, d)
    assert "export FI_PROVIDER=cxi" in script and "export NCCL_NET='AWS Libfabric'" in script
    assert "module load PrgEnv-gnu cudatoolkit" in script
    assert script.rstrip().endswith(f"-m pipeline.cli stage {shlex.quote(str(tmp_path / 'run'))} stage2_grpo")


def test_perlmutter_80g_profile_asks_for_the_hbm80g_nodes(tmp_path):
    profile = load_profile("perlmutter-80g")
    assert (profile.gpu_memory_gib, profile.gpu_name) == (80, "A100-SXM4-80GB")
    d = directives(render_stage_script(profile, tmp_path / "run", "stage2_grpo", 2))
    assert "--constraint=gpu&hbm80g" in d and "--gpus-per-node=4" in d


@pytest.mark.parametrize("nodes", [1, 2, 32])
def test_generic_script_uses_one_task_per_gpu(nodes, tmp_path):
    d = directives(render_stage_script(load_profile("generic"), tmp_path, "stage1_sft", nodes))
    assert f"--nodes={nodes}" in d and "--ntasks-per-node=8" in d and "--gpus-per-node=8" in d
    assert not any(x.startswith("--constraint") for x in d)


@pytest.mark.parametrize("profile", ["perlmutter", "perlmutter-80g", "generic", "local"])
@pytest.mark.parametrize("nodes", [1, 2, 32])
def test_rendered_scripts_pass_shellcheck(profile, nodes, tmp_path):
    script = tmp_path / "stage.sbatch"
    script.write_text(render_stage_script(load_profile(profile), tmp_path / "run dir", "stage1_sft", nodes))
    out = subprocess.run(
        [system_command("shellcheck"), "-s", "bash", str(script)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize("profile", ["perlmutter", "local-multinode"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_the_doctors_probe_is_valid_shell_one_task_a_node_never_requeued(profile, nodes, tmp_path):
    """`hpcr1 doctor`'s job: one task a node with the node's every GPU, a short limit, no requeue,
    and the all_reduce only where there is a link to time; hostile paths stay single words."""
    script = tmp_path / "doctor.sbatch"
    run_dir = tmp_path / "run dir; touch pwned"
    script.write_text(render_doctor_script(load_profile(profile), run_dir / "doctor", run_dir, nodes))
    out = subprocess.run(
        [system_command("shellcheck"), "-s", "bash", str(script)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --time=00:10:00" in text
    assert "--requeue" not in text and "--signal" not in text
    assert ("#SBATCH --gpus-per-node=4" in text) == (profile == "perlmutter")
    assert ("launch.commbench" in text) == (nodes > 1)
    assert shlex.quote(str(run_dir)) in text


def test_srun_line_launches_one_worker_per_task(tmp_path):
    cmd = srun_command(tmp_path, "stage1_sft", "srun")
    assert cmd[:2] == ["srun", "--kill-on-bad-exit=1"] and cmd[-3:] == [
        "launch.worker",
        str(tmp_path),
        "stage1_sft",
    ]


@pytest.fixture
def scontrol_without_slurmctld(tmp_path, monkeypatch):
    """The real scontrol, which expands a node list (first_host) from a slurm.conf alone."""
    system_command("scontrol")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=unit\nSlurmctldHost=localhost\nNodeName=nid[001-002] CPUs=1\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))


@pytest.mark.usefixtures("scontrol_without_slurmctld")
def test_torchrun_line_goes_through_the_wrapper_that_carries_usr1(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "nid[001-002]")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURMD_NODENAME", "nid001")
    cmd = srun_command(tmp_path, "stage1_sft", "torchrun")
    wrapper = cmd.index("launch.torchrun")
    assert cmd[wrapper - 1] == "-m" and cmd[wrapper + 1].endswith("nid001-torchrun-failures.json")
    assert "--rdzv-endpoint=nid001:24242" in cmd and "--nproc-per-node=4" in cmd and "--nnodes=2" in cmd
    assert cmd[-3:] == ["launch.worker", str(tmp_path), "stage1_sft"]


@pytest.mark.usefixtures("scontrol_without_slurmctld")
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_the_ranks_step_overlaps_rays_only_in_a_job_that_hosts_ray(tmp_path, monkeypatch, launcher):
    """A stage on our engines whose held-out eval runs on verl trains beside Ray's steps, which hold
    the GPUs its ranks need: their srun step is --overlap there, and only there."""
    for name, value in {
        "HPCR1_LAUNCHER": launcher,
        "SLURM_JOB_NODELIST": "nid[001-002]",
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
    }.items():
        monkeypatch.setenv(name, value)
    # sinfo asks slurmctld; the step, srun: both are the running Slurm's (tests/slurm run them)
    monkeypatch.setattr("launch.slurm_launch.lost_nodes", lambda nodelist: {})
    steps = []
    # The ranks' step "fails": the stage stops before verl's generation server.
    monkeypatch.setattr(
        "launch.slurm_launch.run_forwarding_usr1", lambda cmd, env, fds: steps.append(cmd) or 1
    )
    assert run_then_eval_on_verl(tmp_path, "stage1_sft") == 1
    assert run_stage_in_allocation(tmp_path, "stage1_sft") == 1
    beside_ray, alone = steps
    assert beside_ray[:2] == ["srun", "--overlap"] and "--overlap" not in alone
    assert beside_ray[2:] == alone[1:]


FAKE_SLURM = {  # what the address lines call, answered as on 2 nodes; srun runs its command here
    "srun": 'while [[ $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done; exec "$@"',
    "scontrol": 'if [[ $2 == hostnames ]]; then printf "node1\\nnode2\\n"; '
    + 'else echo "   NodeAddr=$3 Port=0"; fi',
}


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="bind-mounts /etc/hosts")
def test_the_ray_head_address_reaches_the_other_nodes_where_the_hostname_is_a_loopback(tmp_path):
    """Debian maps a host's own name to 127.0.1.1: the head's address is still the one its route to
    the other node leaves from (node2 resolves, as Slurm's NodeAddr for it, to this machine's
    address), not a loopback. The verl script's address lines run under that /etc/hosts, in a mount
    namespace of their own."""
    global_addrs = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True
    )
    if not global_addrs.stdout.split():
        pytest.skip("no network address on this machine")
    address = global_addrs.stdout.split()[3].split("/")[0]
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n{address} node2\n")
    lines = render_verl_script(
        load_profile("local-multinode"), tmp_path / "run", "stage2_grpo", 2
    ).splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("mapfile -t nodes"))
    last = next(i for i, line in enumerate(lines) if line.startswith("export RAY_ADDRESS="))
    (tmp_path / "address.sh").write_text(
        "\n".join(["set -euo pipefail", *lines[first : last + 1], 'echo "$head_ip"'])
    )
    for name, body in FAKE_SLURM.items():
        (tmp_path / name).write_text(f"#!/bin/bash\n{body}\n")
        (tmp_path / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[1-2]"}
    out = subprocess.run(
        [
            "unshare",
            "--mount",
            "sh",
            "-c",
            'mount --bind "$0" /etc/hosts && exec bash "$1"',
            hosts,
            tmp_path / "address.sh",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [address], out.stdout + out.stderr


HOSTILE = [
    'it\'s "quoted"',
    "$(touch /tmp/pwned)",
    "`touch /tmp/pwned`",
    "new\nline; touch /tmp/pwned",
    "spa ces & ; | > /tmp/pwned",
]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_run_dir_stays_one_inert_argument(hostile, tmp_path):
    PWNED.unlink(missing_ok=True)
    run_dir = tmp_path / hostile
    script = tmp_path / "stage.sbatch"
    text = render_stage_script(load_profile("local"), run_dir, "stage1_sft", 1)
    # Make the script print its final command's arguments instead of running the stage.
    text = text.replace("exec ", "exec printf '%s\\n' ", 1)
    script.write_text(text)
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    args = out.stdout.split("\n")
    assert not PWNED.exists(), "a hostile string was executed"
    assert str(run_dir) in out.stdout and "stage1_sft" in args
    assert all(not line.startswith("#SBATCH") or "\n" not in line for line in text.splitlines())
    cmd = sbatch_command(script, run_dir, "stage1_sft", None)
    assert any(str(run_dir) in arg for arg in cmd)  # one argv element, never parsed by a shell


def test_hostile_profile_values_are_rejected(tmp_path):
    from core.config import ConfigError

    bad = tmp_path / "bad.yaml"
    bad.write_text('name: bad\naccount: "m1234\\n#SBATCH --wrap=touch /tmp/pwned"\n')
    with pytest.raises(ConfigError, match="account"):
        load_profile(str(bad))


def test_only_the_test_clusters_run_verl_on_the_cpu_platform_and_a_gpu_profile_cannot(tmp_path):
    from core.cluster import PROFILES
    from core.config import ConfigError

    for path in PROFILES.glob("*.yaml"):
        profile = load_profile(str(path))
        assert (profile.verl_platform == "cpu") == (profile.gpus_per_node == 0), path.name
    local = load_profile("local")
    script = render_verl_script(local, tmp_path / "run", "stage2_grpo", 1)
    # Ray counts each rank as a GPU, and holds enough logical CPUs for verl's actors
    assert "--num-gpus=2 --num-cpus=14 --block" in script and "HPCR1_VERL_PLATFORM=cpu" in script
    assert "--gpus-per-node=0" in script  # asks Slurm for no GPUs
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "bad", "gpus_per_node": 4, "verl_platform": "cpu"}))
    with pytest.raises(ConfigError, match="gpus_per_node must be 0"):
        load_profile(str(bad))


@pytest.mark.parametrize(
    "constraint", ["gpu;touch /tmp/pwned", "gpu&hbm80g\n#SBATCH --wrap=x", "gpu $(id)", "a`id`"]
)
def test_constraints_outside_slurms_grammar_are_rejected(tmp_path, constraint):
    from core.config import ConfigError

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "bad", "constraint": constraint}))
    with pytest.raises(ConfigError, match="constraint"):
        load_profile(str(bad))


@pytest.mark.parametrize("constraint", ["gpu&hbm80g", "[rack1|rack2]", "(a&b)|c", "knl*2"])
def test_slurm_constraint_grammar_is_accepted(tmp_path, constraint):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"name": "good", "constraint": constraint}))
    assert load_profile(str(good)).constraint == constraint
