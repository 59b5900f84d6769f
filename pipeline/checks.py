"""Checks of where a run will go, before anything is queued: each a PASS, WARN or FAIL row with its
fix in one line. `hpcr1 submit` runs those that need no job and refuses on a FAIL (--skip-checks
submits anyway)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from analysis.disk import StageDisk, run_disk
from analysis.memory import PROMPT_TOKENS
from analysis.model_shape import LlamaShape
from analysis.plan import NO_FIT, Machine, StagePlan, changed_lines, plan_stage
from analysis.plan_report import gb
from core.cluster import ClusterProfile, Container
from core.config import EvalConfig, RunConfig
from launch.doctor_probe import free_room

# Below this share of room beyond the planned bytes the check warns: logs, communication profiles,
# wandb and the caches want some too.
DISK_HEADROOM = 1.25


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str
    """PASS, WARN or FAIL."""
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.verdict:<4}  {self.name}: {self.detail}" + (f" -> {self.fix}" if self.fix else "")


def checks_without_a_job(
    cfg: RunConfig, run_root: Path, shape: LlamaShape, profile: ClusterProfile, stage_ids: list[str]
) -> list[tuple[str, Check]]:
    """(the field a FAIL names, the check): each of `stage_ids`' memory on the profile's GPUs, then
    the run directory's room for what they write."""
    planned = run_disk(cfg, shape.params(), profile.gpus_per_node > 0, stage_ids)
    return memory_checks(cfg, shape, profile, stage_ids) + [("--run-dir", disk_check(run_root, planned))]


def memory_checks(
    cfg: RunConfig, shape: LlamaShape, profile: ClusterProfile, stage_ids: list[str]
) -> list[tuple[str, Check]]:
    """A CPU profile has no GPU memory to check: the planner models CUDA GPUs."""
    if not profile.gpus_per_node:
        return []
    machine = Machine.from_profile(profile)
    plans = [
        plan_stage(sid, getattr(cfg, sid), cfg, shape, machine, [cfg.nproc], PROMPT_TOKENS)
        for sid in stage_ids
    ]
    return [memory_check(p, machine, cfg.eval) for p in plans]


def disk_check(run_root: Path, planned: list[StageDisk]) -> Check:
    """The run directory's file system against the bytes and files the stages still to run write."""
    if not planned:
        return Check("run directory space", "PASS", "every stage is done: nothing more to write")
    room = free_room(run_root)
    where, free, need = room["path"], room["free_bytes"], sum(s.total_bytes for s in planned)
    files = sum(s.files for s in planned)
    largest = max(planned, key=lambda s: s.total_bytes)
    most = f"{largest.stage} {gib(largest.total_bytes)} the most"
    detail = f"{gib(need)} planned ({most}), {gib(free)} free on {where}"
    fix = "free space there, lower keep_checkpoints, or --run-dir on a larger file system"
    if free < need:
        return Check("run directory space", "FAIL", detail, fix)
    if room["counts_inodes"] and room["free_inodes"] < files:
        detail = f"{files} files planned, {room['free_inodes']} inodes free on {where}"
        return Check("run directory inodes", "FAIL", detail, "free inodes there, or --run-dir elsewhere")
    if free < DISK_HEADROOM * need:
        return Check("run directory space", "WARN", detail + ": little room for logs and profiles", fix)
    return Check("run directory space", "PASS", detail)


def memory_check(p: StagePlan, machine: Machine, e: EvalConfig) -> tuple[str, Check]:
    """A stage as configured against one GPU and one node of the profile: the planner's footprint,
    its micro-batches' activations and the rollout's KV cache included (`hpcr1 plan`). With it, the
    field a FAIL names: the planner's first change, else the GPU count."""
    o, name = p.configured, f"{p.stage_id} memory"
    fp, n = o.footprint, o.layout.gpus
    peak = f" (peak: {fp.peak_phase()})" if fp.phases else ""
    # in GB, as `hpcr1 plan` prints them
    detail = f"{gb(fp.gpu_bytes())} GB a GPU{peak} and {gb(fp.host_bytes())} GB a node at nproc={n}"
    if o.verdict != NO_FIT:
        caveats = f": {'; '.join(o.caveats)}" if o.caveats else ""
        return "nproc", Check(name, "WARN" if o.caveats else "PASS", detail + caveats)
    over = [
        f"{what} above the {gb(usable)} GB usable of {where}"
        for what, used, usable, where in (
            ("GPU", fp.gpu_bytes(), machine.usable_gpu, f"one {machine.gpu_name}"),
            ("host", fp.host_bytes(), machine.usable_host, "a node"),
        )
        if used > usable
    ]
    why = "; ".join(over + list(fp.refusals))
    changes = [] if p.planned.verdict == NO_FIT else changed_lines(p, e)
    if changes:
        fix = "`hpcr1 plan` fits it with " + " ".join(changes)
        return changes[0].split("=", 1)[0], Check(name, "FAIL", f"{detail}: {why}", fix)
    fix = f"no layout fits at nproc={n}: more GPUs (`hpcr1 plan` gives the counts that fit)"
    return "nproc", Check(name, "FAIL", f"{detail}: {why}", fix)


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# The oldest Linux driver each CUDA major runs on (NVIDIA's CUDA Toolkit release notes, "minor
# version compatibility"): a build for 12.8 runs on any 12.x driver from 525.60.13 on.
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
SMI_HEADER = re.compile(r"Driver Version:\s*([\d.]+)\s+CUDA Version:\s*([\d.]+)")
# A wheel built for one CUDA major says so in its name: nvidia-cublas-cu12, transformer_engine_cu13.
CUDA_WHEEL = re.compile(r"[-_]cu(\d{2})(?:$|[-_])", re.IGNORECASE)


def cuda_needs(torch_cuda: str | None, packages: dict[str, str]) -> dict[str, int]:
    """{package and version: the CUDA major it was built for}: torch's own build, and every wheel
    whose name carries a CUDA major (vLLM's and Transformer Engine's libraries among them)."""
    needs = (
        {f"torch {packages.get('torch', '?')} (CUDA {torch_cuda})": int(torch_cuda.split(".")[0])}
        if torch_cuda
        else {}
    )
    for name, version in sorted(packages.items()):
        match = CUDA_WHEEL.search(name)
        if match:
            needs[f"{name} {version}"] = int(match.group(1))
    return needs


def driver_check(node: str, nvidia_smi: str | None, needs: dict[str, int]) -> Check:
    """The node's driver against the newest CUDA major the venv's wheels were built for."""
    if not needs:
        return Check(f"driver on {node}", "PASS", "the venv holds no CUDA build")
    header = SMI_HEADER.search(nvidia_smi or "")
    if header is None:
        fix = "run on GPU nodes (the profile's partition and constraint)"
        return Check(f"driver on {node}", "FAIL", "no NVIDIA driver (nvidia-smi missing or silent)", fix)
    driver, supports = header.group(1), header.group(2)
    major = max(needs.values())
    newest = [package for package, m in needs.items() if m == major]
    named = [p for p in newest if p.startswith(("torch ", "transformer_engine", "vllm"))] or newest[:1]
    rest = len(newest) - len(named)
    packages = ", ".join(named) + (f" and {rest} more CUDA {major} wheels" if rest else "")
    need = MIN_DRIVER.get(major)
    detail = f"driver {driver} (CUDA {supports})"
    if need and version_tuple(driver) < version_tuple(need):
        fix = f"a newer driver, or a venv built for the node's CUDA {supports.split('.')[0]}"
        return Check(
            f"driver on {node}", "FAIL", f"{packages} need driver >= {need}, the node has {detail}", fix
        )
    return Check(f"driver on {node}", "PASS", f"{detail} runs {packages}")


def gpu_check(node: str, nvidia_smi: str | None, gpus_per_node: int, gpu_memory_gib: float) -> Check:
    """The GPUs nvidia-smi lists (name, MiB) against the profile's count and memory."""
    rows = (nvidia_smi or "").split("--query-gpu=name,memory.total\n", 1)[-1] if nvidia_smi else ""
    gpus = [row.rsplit(",", 1) for row in rows.splitlines() if "," in row]
    seen = ", ".join(f"{name.strip()} {float(mib) / 1024:.0f} GiB" for name, mib in gpus) or "none"
    fix = "fix the profile's gpus_per_node / gpu_memory_gib, or its partition and constraint"
    if len(gpus) != gpus_per_node:
        return Check(
            f"GPUs on {node}", "FAIL", f"{len(gpus)} seen ({seen}), the profile says {gpus_per_node}", fix
        )
    short = [name for name, mib in gpus if float(mib) / 1024 < 0.95 * gpu_memory_gib]
    if short:
        return Check(f"GPUs on {node}", "FAIL", f"{seen}: less than the profile's {gpu_memory_gib} GiB", fix)
    return Check(f"GPUs on {node}", "PASS", seen if gpus else "none, as the profile says")


# Runtimes that mark their containers as another does: podman-hpc's are podman's, and apptainer also
# answers to singularity.
SAME_MARK = {"podman-hpc": "podman", "singularity": "apptainer"}


def container_check(node: str, seen: str, container: Container | None) -> Check:
    """The probe's step ran in the container the profile names (runtime/linux.py: container_here);
    pyxis's enroot follows no one convention, so any container will do for it."""
    name = f"container on {node}"
    if container is None:
        return Check(name, "PASS", f"the profile names none (the step saw: {seen})")
    runtime = seen.split()[0]
    wanted = SAME_MARK.get(container.runtime, container.runtime)
    if runtime != "none" and (container.runtime == "pyxis" or SAME_MARK.get(runtime, runtime) == wanted):
        return Check(name, "PASS", f"{seen}, image {container.image}")
    return Check(
        name,
        "FAIL",
        f"the step ran in {seen}, the profile says {container.runtime} ({container.image})",
        "run the profile's runtime by hand on a node (srun RUNTIME ... IMAGE true) and read its error",
    )


def python_check(facts: dict, here: dict) -> Check:
    """The node runs the Python the submitting host does (the jobs use the one that submitted them),
    on a glibc the lock's manylinux_2_28 wheels load on."""
    node = facts["host"]
    glibc = tuple(int(x) for x in facts["glibc"].split()[-1].split(".")[:2])
    if (facts["executable"], facts["python"]) != (here["executable"], here["python"]):
        theirs, ours = (f"{f['executable']} {f['python']}" for f in (facts, here))
        detail = f"{theirs} where this host has {ours}"
        return Check(
            f"Python on {node}",
            "FAIL",
            detail,
            "the venv on a file system every node mounts at the same path",
        )
    if glibc < (2, 28):
        return Check(
            f"Python on {node}", "FAIL", f"{facts['glibc']}: the wheels need glibc 2.28", "a newer OS image"
        )
    return Check(f"Python on {node}", "PASS", f"{facts['python']} at {facts['executable']}, {facts['glibc']}")


def bandwidth_check(
    nodes: int, bench: dict | None, expected_gbs: float | None, transport: str | None
) -> Check:
    """The all_reduce between the nodes against the profile's expected bus bandwidth; NCCL on
    plain sockets fails whatever the figure."""
    name = f"all_reduce across {nodes} nodes"
    if bench is None:
        return Check(name, "FAIL", "the probe job measured nothing (its output is in the doctor directory)")
    best = max(row["busbw_GBps"] for row in bench["results"]["all_reduce"])
    over = f"{bench['backend']}" + (f" over {transport}" if transport else "")
    detail = f"{best:.3f} GB/s bus bandwidth ({over})"
    if transport == "Socket":
        return Check(
            name,
            "FAIL",
            f"{detail}: NCCL fell back to TCP sockets",
            "load the fabric's NCCL plugin (aws-ofi-nccl) and set NCCL_NET",
        )
    if expected_gbs is not None and best < expected_gbs:
        expected = f"the profile expects at least {expected_gbs} GB/s (expected_bus_gbs)"
        fix = "check the links between the nodes (shaping, a failed NIC, the wrong interface)"
        return Check(name, "FAIL", f"{detail}, {expected}", fix)
    return Check(name, "PASS", detail + (f", at least {expected_gbs} GB/s expected" if expected_gbs else ""))


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))
