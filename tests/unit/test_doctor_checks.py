"""`hpcr1 doctor`'s judgements of what its probe found (pipeline/checks.py), on recorded nvidia-smi
outputs of real drivers (fixtures/nvidia-smi/) and the real wheels of the GPU lock: a CUDA 13 venv
on Perlmutter's 2023 driver fails naming both versions, on a 580 driver it passes; the GPUs seen
are held against the profile; a link below the profile's expectation fails naming both figures."""

from __future__ import annotations

from core.cluster import load_profile
from pipeline.checks import bandwidth_check, cuda_needs, driver_check, gpu_check, python_check
from tests.conftest import REPO

SMI = REPO / "tests" / "unit" / "fixtures" / "nvidia-smi"


def gpu_lock() -> dict[str, str]:
    """requirements-gpu.lock's pins: the wheels `make setup-gpu` installs."""
    pins = {}
    for line in (REPO / "requirements-gpu.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.split("[")[0].strip()] = version.split()[0]
    return pins


def test_the_gpu_locks_cuda_13_needs_a_580_driver_and_perlmutters_2023_driver_fails_naming_both():
    needs = cuda_needs("13.0", gpu_lock())
    assert needs["torch 2.11.0 (CUDA 13.0)"] == 13 and needs["transformer_engine_cu13 2.17.1"] == 13
    check = driver_check("nid001045", (SMI / "perlmutter-a100-525.105.17.txt").read_text(), needs)
    assert check.verdict == "FAIL", check
    assert "torch 2.11.0 (CUDA 13.0), transformer_engine_cu13 2.17.1 and " in check.detail
    assert "need driver >= 580.65.06, the node has driver 525.105.17 (CUDA 12.0)" in check.detail, check
    ok = driver_check("h100", (SMI / "h100-580.65.06.txt").read_text(), needs)
    assert ok.verdict == "PASS" and "driver 580.65.06 (CUDA 13.0)" in ok.detail, ok


def test_a_cuda_12_venv_runs_on_the_525_driver_and_no_driver_at_all_fails():
    needs = cuda_needs("12.8", {"torch": "2.7.1", "nvidia-cublas-cu12": "12.8.3.14"})
    assert (
        driver_check("nid001045", (SMI / "perlmutter-a100-525.105.17.txt").read_text(), needs).verdict
        == "PASS"
    )
    assert driver_check("login", None, needs).verdict == "FAIL"


def test_the_gpus_are_held_against_the_profile():
    smi = (SMI / "perlmutter-a100-525.105.17.txt").read_text()
    perlmutter, perlmutter_80g = load_profile("perlmutter"), load_profile("perlmutter-80g")
    ok = gpu_check("nid001045", smi, perlmutter.gpus_per_node, perlmutter.gpu_memory_gib)
    assert ok.verdict == "PASS" and ok.detail.count("NVIDIA A100-SXM4-40GB 40 GiB") == 4, ok
    big = gpu_check("nid001045", smi, perlmutter_80g.gpus_per_node, perlmutter_80g.gpu_memory_gib)
    assert big.verdict == "FAIL" and "less than the profile's 80" in big.detail, big
    assert gpu_check("cpu01", None, 4, 40).verdict == "FAIL"
    assert gpu_check("cpu01", None, 0, 0).verdict == "PASS"


def test_a_link_below_the_profiles_expectation_fails_naming_both_figures():
    bench = {"backend": "gloo", "results": {"all_reduce": [{"bytes": 2**26, "busbw_GBps": 0.0031}]}}
    check = bandwidth_check(2, bench, 0.2, None)
    assert check.verdict == "FAIL"
    assert "0.003 GB/s bus bandwidth (gloo), the profile expects at least 0.2 GB/s" in check.detail, check
    assert bandwidth_check(2, bench, 0.001, None).verdict == "PASS"
    assert bandwidth_check(2, bench, None, "Socket").verdict == "FAIL"  # NCCL on TCP: whatever the figure
    assert bandwidth_check(2, None, 0.2, None).verdict == "FAIL"


def test_a_node_with_another_python_or_an_old_glibc_fails():
    here = {"executable": "/scratch/hpcr1/.venv-gpu/bin/python", "python": "3.12.11"}
    node = {"host": "nid1", **here, "glibc": "glibc 2.31"}
    assert python_check(node, here).verdict == "PASS"
    assert python_check({**node, "python": "3.11.7"}, here).verdict == "FAIL"
    old = python_check({**node, "glibc": "glibc 2.17"}, here)
    assert old.verdict == "FAIL" and "2.28" in old.detail


def test_doctor_without_slurms_commands_is_refused_naming_the_cluster(tmp_path, monkeypatch, capsys):
    from pipeline.cli import main

    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    argv = [
        "doctor",
        str(REPO / "configs" / "tiny-cpu.yaml"),
        "--cluster",
        "local",
        "--run-dir",
        str(tmp_path / "r"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpcr1: error: --cluster: sbatch is not on PATH") and "Traceback" not in err, err
    assert not (tmp_path / "r").exists()
