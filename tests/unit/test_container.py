"""A cluster profile's container (core/cluster.py: Container, launch/container.py): the words each
runtime gets, the job scripts that carry them (valid shell, hostile paths inert, the driver's srun
steps wrapped as the script's own, verl's Ray in it), the doctor's verdict on where its probe ran, and
the containers the runtimes cannot take.
The real runs are tests/slurm/test_slurm_container.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from core.cluster import Container, load_profile
from core.config import ConfigError
from launch.container import CONTAINER_ENV, words_from_env
from launch.sbatch import render_doctor_script, render_stage_script, render_verl_script
from launch.slurm_launch import srun_command
from pipeline.checks import container_check
from pipeline.cli import main
from tests.conftest import REPO
from tests.support.system_packages import system_command

HOSTILE = "run dir; touch pwned 'x' $(id)"


def profile_with(tmp_path: Path, **container) -> Path:
    profile = yaml.safe_load((REPO / "slurm/profiles/local.yaml").read_text())
    profile["container"] = container
    path = tmp_path / "with-container.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def exported_words(script: str) -> dict:
    """HPCR1_CONTAINER as bash leaves it after the script's own export line."""
    [line] = [line for line in script.splitlines() if line.startswith(f"export {CONTAINER_ENV}=")]
    out = subprocess.run(
        ["bash", "-c", f'{line}\nprintf %s "${CONTAINER_ENV}"'], capture_output=True, text=True
    )
    return json.loads(out.stdout)


def test_podman_runs_each_step_in_the_nodes_namespaces_with_the_project_and_run_directory_mounted(tmp_path):
    path = profile_with(tmp_path, runtime="podman", image="site/ranks:1", mounts=["/opt/python"],
                        options=["--runtime=/usr/bin/runc"])  # fmt: skip
    run = tmp_path / HOSTILE
    script = render_stage_script(load_profile(str(path)), run, "stage1_sft", 1)
    words = exported_words(script)
    assert words["srun"] == []
    assert words["command"] == [
        "podman", "run", "--rm", "--network=host", "--ipc=host", "--pid=host", "--env-host",
        "--volume", f"{REPO}:{REPO}", "--volume", f"{run}:{run}", "--volume", "/opt/python:/opt/python",
        f"--workdir={REPO}", "--runtime=/usr/bin/runc", "site/ranks:1",
        sys.executable, "-m", "launch.task_guard",  # ends the container with its srun task
    ]  # fmt: skip


def test_the_driver_wraps_its_srun_steps_as_the_script_says(tmp_path, monkeypatch):
    for runtime, image in (
        ("podman", "site/ranks:1"),
        ("apptainer", "/images/ranks.sif"),
        ("pyxis", "ranks.sqsh"),
    ):
        path = profile_with(tmp_path, runtime=runtime, image=image)
        run = tmp_path / HOSTILE
        words = exported_words(render_stage_script(load_profile(str(path)), run, "stage1_sft", 1))
        monkeypatch.setenv(CONTAINER_ENV, json.dumps(words))
        cmd = srun_command(run, "stage1_sft", "srun")
        worker = len(cmd) - 5  # python -m launch.worker RUN_DIR STAGE
        assert cmd[worker:] == [sys.executable, "-m", "launch.worker", str(run), "stage1_sft"]
        assert cmd[:worker] == [
            "srun",
            "--kill-on-bad-exit=1",
            "--cpu-bind=none",
            *words["srun"],
            *words["command"],
        ]
        if runtime == "apptainer":
            assert words["command"] == [
                "apptainer",
                "exec",
                "--bind",
                f"{REPO},{run}",
                "--pwd",
                str(REPO),
                image,
            ]
        if runtime == "pyxis":
            assert words["command"] == [] and words["srun"] == [
                f"--container-image={image}", f"--container-mounts={REPO}:{REPO},{run}:{run}",
                f"--container-workdir={REPO}",
            ]  # fmt: skip
    monkeypatch.delenv(CONTAINER_ENV)
    assert words_from_env().command == [] and srun_command(tmp_path, "s", "srun")[3] != "podman"


@pytest.mark.parametrize("nodes", [1, 2])
def test_scripts_with_a_container_pass_shellcheck_and_the_doctors_probes_run_in_it(tmp_path, nodes):
    profile = load_profile(
        str(profile_with(tmp_path, runtime="podman-hpc", image="ranks", options=["--gpu"]))
    )
    run = tmp_path / "run dir; touch pwned"  # (a $ in single quotes is shellcheck's SC2016: inert, as meant)
    scripts = {
        "stage": render_stage_script(profile, run, "stage1_sft", nodes),
        "doctor": render_doctor_script(profile, run / "doctor", run, nodes),
    }
    for name, text in scripts.items():
        shellcheck = [system_command("shellcheck"), "-s", "bash", "-"]
        out = subprocess.run(shellcheck, input=text, capture_output=True, text=True)
        assert out.returncode == 0, (name, out.stdout)
    probes = [line for line in scripts["doctor"].splitlines() if line.startswith("srun ")]
    assert len(probes) == nodes and all('"${srun_container[@]}" "${in_container[@]}"' in p for p in probes)
    arrays = scripts["doctor"].split("in_container=(", 1)[1].split(")", 1)[0]
    assert arrays.startswith("podman-hpc run --rm") and "--gpu ranks" in arrays
    assert f"--volume {run / 'doctor'}:" in arrays.replace("'", "")  # the probes write there


@pytest.mark.parametrize(
    ("container", "field"),
    [
        ({"runtime": "docker", "image": "x"}, "container.runtime"),
        ({"runtime": "podman", "image": ""}, "container.image"),
        ({"runtime": "apptainer", "image": "x.sif", "mounts": ["relative/dir"]}, "container.mounts"),
        ({"runtime": "pyxis", "image": "x", "mounts": ["/a:/b"]}, "container.mounts"),
    ],
)
def test_a_container_the_runtimes_cannot_take_is_refused_naming_the_field(tmp_path, container, field):
    with pytest.raises(ConfigError, match=f"with-container.yaml:{field}"):
        load_profile(str(profile_with(tmp_path, **container)))


def test_verls_ray_starts_in_the_container_where_the_batch_shell_and_driver_reach_it_by_tmp(tmp_path):
    """The node-address probe and every node's Ray run in the container; the batch shell's Ray CLI and
    the stage driver stay outside and reach Ray through its sockets in the mounted /tmp."""
    profile = load_profile(str(profile_with(tmp_path, runtime="podman", image="ranks")))
    run = tmp_path / "run dir; touch pwned"
    script = render_verl_script(profile, run, "stage2_grpo", 2)
    out = subprocess.run([system_command("shellcheck"), "-s", "bash", "-"], input=script, capture_output=True,
                         text=True)  # fmt: skip
    assert out.returncode == 0, out.stdout
    steps = [line for line in script.splitlines() if "srun " in line and not line.lstrip().startswith("#")]
    assert len(steps) == 3 and all(
        '"${srun_container[@]}"' in s and '"${in_container[@]}"' in s for s in steps
    )
    assert "--volume /tmp:/tmp" in script.split("in_container=(", 1)[1].split(")", 1)[0]
    assert exported_words(script)["command"][-3:] == [sys.executable, "-m", "launch.task_guard"]


def test_the_doctor_holds_where_its_probe_ran_against_the_profile():
    podman_hpc = Container(runtime="podman-hpc", image="ranks")
    assert container_check("n1", "podman", podman_hpc).verdict == "PASS"
    assert (
        container_check("n1", "apptainer /images/r.sif", Container(runtime="singularity", image="r")).verdict
        == "PASS"
    )
    assert container_check("n1", "enroot", Container(runtime="pyxis", image="r")).verdict == "PASS"
    missed = container_check("n1", "none", podman_hpc)
    assert missed.verdict == "FAIL" and "ran in none, the profile says podman-hpc (ranks)" in missed.detail
    assert container_check("n1", "apptainer x", podman_hpc).verdict == "FAIL"
    assert container_check("n1", "podman", None).verdict == "PASS"


@pytest.mark.parametrize("command", ["submit", "doctor"])
def test_a_run_directory_the_mount_options_cannot_take_is_refused_before_anything_is_written(
    tmp_path, capsys, command
):
    path = profile_with(tmp_path, runtime="apptainer", image="/images/ranks.sif")
    run = tmp_path / "runs:2026,12"
    argv = [command, str(REPO / "configs/tiny-cpu.yaml"), "--cluster", str(path), "--run-dir", str(run)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--run-dir" in err and "apptainer's mount option" in err, err
    assert not run.exists()
