"""Cluster profiles (slurm/profiles/<name>.yaml): what an expert would put in an sbatch script for
that machine. Typed like the run config: unknown keys and wrong types are errors naming the field."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import Field, PositiveFloat, ValidationError, field_validator, model_validator

from core.config import ConfigError, Section

# Seconds a rank waits in one collective (any process group) before it raises (runtime.dist): the stage
# job exports the profile's collective_timeout_s in it. Unset: torch's defaults (30 min gloo, 10 NCCL).
COLLECTIVE_TIMEOUT_ENV = "HPCR1_COLLECTIVE_TIMEOUT_S"

PROFILES = Path(__file__).resolve().parents[1] / "slurm" / "profiles"
# Values that go into #SBATCH lines: sbatch parses those lines itself, so they must be plain tokens.
_DIRECTIVE_VALUE = re.compile(r"^[A-Za-z0-9_.:,@%=+/-]*$")
# Slurm's --constraint grammar adds AND (&), OR (|), matching OR ([...]), counts (*n) and grouping
# ((...)); inside an #SBATCH line, a comment to bash, none of them is read by a shell.
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.:,@%=+/&|\[\]*()-]*$")
Port = Annotated[int, Field(ge=1, le=65535)]


def ephemeral_ports(sysctl: Path = Path("/proc/sys/net/ipv4")) -> tuple[range, set[int]]:
    """The range of ports Linux may give an outgoing connection on this machine
    (ip_local_port_range), and those of it reserved (ip_local_reserved_ports: "8080,9000-9010").
    Empty where the files are absent (not Linux)."""
    try:
        low, high = map(int, (sysctl / "ip_local_port_range").read_text().split())
    except OSError:
        return range(0), set()
    reserved: set[int] = set()
    with contextlib.suppress(OSError):
        for part in filter(None, (sysctl / "ip_local_reserved_ports").read_text().strip().split(",")):
            first, _, last = part.partition("-")
            reserved.update(range(int(first), int(last or first) + 1))
    return range(low, high + 1), reserved


class RayPorts(Section):
    """Where the Ray cluster of a verl stage listens: fixed ports, so a site can open them in its
    firewall and two jobs on one node can be told apart (give them different profiles). None may lie
    in the node's ephemeral range (Linux: net.ipv4.ip_local_port_range, 32768-60999 by default)
    unless reserved: any outgoing connection may hold such a port when Ray binds it, and the agent
    that fails ("Address already in use") takes the raylet down with it."""

    gcs_port: Port = 6379
    """The head's GCS server (the address workers join)."""
    node_manager_port: Port = 6380
    """Each node's raylet."""
    object_manager_port: Port = 6381
    """Each node's object manager."""
    client_server_port: Port = 10001
    """The head's Ray client server."""
    dashboard_port: Port = 8265
    """The head's (minimal) dashboard server, which Ray starts even with the dashboard UI off."""
    min_worker_port: Port = 10002
    """Lowest port a Ray worker process may take."""
    max_worker_port: Port = 10999
    """Highest port a Ray worker process may take."""
    dashboard_agent_listen_port: Port = 6382
    """Each node's dashboard agent (HTTP); Ray starts it even without the dashboard."""
    dashboard_agent_grpc_port: Port = 6383
    """Each node's dashboard agent (gRPC)."""
    runtime_env_agent_port: Port = 6384
    """Each node's runtime-environment agent."""
    metrics_export_port: Port = 6385
    """Each node's Prometheus metrics endpoint."""
    ready_timeout_s: Annotated[int, Field(gt=0)] = 600
    """Seconds to wait for every node to join with its GPUs before the job fails."""

    @model_validator(mode="after")
    def _ports_apart(self):
        """Ray refuses to start on a port taken twice or a component port inside the worker range:
        on the cluster, after the job has waited in the queue. Said here, when the profile is read."""
        low, high = self.min_worker_port, self.max_worker_port
        if low > high:
            raise ValueError(f"min_worker_port {low} is above max_worker_port {high}")
        seen: dict[int, str] = {}
        for field, port in self.component_ports().items():
            if low <= port <= high:
                raise ValueError(f"{field} {port} is inside the worker port range {low}-{high}")
            if port in seen:
                raise ValueError(f"{field} and {seen[port]} are both {port}")
            seen[port] = field
        span, reserved = ephemeral_ports()
        for field, port in {
            **self.component_ports(),
            "min_worker_port": low,
            "max_worker_port": high,
        }.items():
            if port in span and port not in reserved:
                raise ValueError(
                    f"{field} {port} is inside this machine's ephemeral port range "
                    f"{span.start}-{span.stop - 1}, where any outgoing connection may hold it "
                    "when Ray binds it: choose a port outside it, or reserve it "
                    "(net.ipv4.ip_local_reserved_ports)"
                )
        return self

    def component_ports(self) -> dict[str, int]:
        """Every fixed port, by field name: all but the worker range's bounds."""
        return {
            field: port
            for field, port in self.model_dump().items()
            if field.endswith("_port") and field not in ("min_worker_port", "max_worker_port")
        }


ContainerRuntime = Literal["podman", "podman-hpc", "apptainer", "singularity", "pyxis"]


class Container(Section):
    """A container every srun step of the profile's jobs runs in (the ranks, Ray, the doctor's probes),
    with the project and the run directory mounted at their own paths (launch/container.py). The
    batch script and the stage driver stay on the node, where srun is: the driver's Python (the
    venv's) must be there, the image holding what the ranks need beyond the mounted project."""

    runtime: ContainerRuntime
    """'podman' or 'podman-hpc' (`run`), 'apptainer' or 'singularity' (`exec`), or 'pyxis' (srun's
    --container-image)."""
    image: str = Field(min_length=1)
    """The image: a podman image name, an apptainer .sif path, or pyxis's image (a squashfs file or
    a registry reference enroot can import)."""
    mounts: list[str] = []
    """More host directories mounted at the same path, e.g. the Python installation the venv was made
    from, or the site's software tree."""
    options: list[str] = []
    """More options to the runtime (after `run` or `exec`; for pyxis, to srun), e.g. '--gpu' for
    podman-hpc or '--nv' for apptainer."""

    @field_validator("mounts")
    @classmethod
    def _absolute(cls, values):
        for value in values:
            if not value.startswith("/") or ":" in value or "," in value:
                raise ValueError(f"{value!r} is not an absolute path without ':' or ','")
        return values


class ClusterProfile(Section):
    name: str
    """Profile name (the --cluster value)."""
    launcher: Literal["srun", "torchrun"] = "srun"
    """'srun': one task per rank (rank/world from the Slurm env); 'torchrun': one per node, c10d
    rendezvous."""
    gpus_per_node: int = 0
    """GPUs per node (0 on CPU clusters); with srun, tasks per node = GPUs per node."""
    gpu_name: str | None = None
    """GPU model, for the memory planner's report (e.g. 'A100-SXM4-40GB')."""
    gpu_memory_gib: float = 0
    """Memory of one GPU in GiB, as nvidia-smi reports it (what `hpcr1 plan` fits into)."""
    host_memory_gib: float = 0
    """Host (CPU) memory of one node in GiB."""
    gpu_bf16_tflops: PositiveFloat | None = None
    """Dense bf16 peak of one GPU in TFLOP/s, from its datasheet: with the next two, `hpcr1 plan`
    estimates a GRPO step split between generating and training GPUs (analysis/plan_split.py)."""
    gpu_memory_bandwidth_gbs: PositiveFloat | None = None
    """Memory bandwidth of one GPU in GB/s, from its datasheet (decoding reads every weight a token)."""
    nic_gbs: PositiveFloat | None = None
    """Bandwidth of one network interface in GB/s: what the weight hand-over to a rollout pool of
    its own crosses, one sender to its receivers."""
    expected_bus_gbs: PositiveFloat | None = None
    """The all_reduce bus bandwidth between two nodes, in GB/s, below which `hpcr1 doctor` fails its
    network check (a link shaped, a NIC down, NCCL on the wrong interface). None: not checked."""
    ranks_per_node: int = 2
    """Ranks per node when gpus_per_node is 0."""
    cpus_per_task: int = 1
    """CPU cores per rank."""
    partition: str | None = None
    """Slurm partition (-p)."""
    account: str | None = None
    """Slurm account (-A)."""
    qos: str | None = None
    """Quality of service (-q)."""
    constraint: str | None = None
    """Node features (-C), e.g. 'gpu' on Perlmutter."""
    time_limit: str = "02:00:00"
    """Wall-clock limit per stage job (--time)."""
    signal_seconds: int = 120
    """Seconds before the limit at which the stage is told to checkpoint and requeue (--signal=B:USR1@s)."""
    requeue: bool = True
    """Let preempted or time-limited jobs be requeued (--requeue)."""
    collective_timeout_s: int = Field(default=600, ge=1)
    """Seconds a rank waits in one collective before it fails the stage (gloo and NCCL, every process
    group): what bounds a stage whose peer's node vanished or was cut off, the ranks blocked on it
    otherwise waiting torch's default (30 min for gloo). Longer than any step's slowest rank waits."""
    extra_directives: list[str] = []
    """More #SBATCH options, e.g. '--exclusive' (plain tokens only)."""
    env: dict[str, str] = {}
    """Environment set before launch (NCCL/libfabric settings, caches)."""
    setup: list[str] = []
    """Shell lines run before the stage, e.g. 'module load cudatoolkit' (trusted: written by the site)."""
    slurm_conf: str | None = None
    """The Slurm config file (SLURM_CONF) that sbatch, squeue, sacct and scancel read for this cluster,
    for one whose clients do not find theirs (the local ones); unset: the clients' own lookup."""
    ray: RayPorts = RayPorts()
    """Ports and start-up timeout of the Ray cluster a verl GRPO stage starts on its allocation."""
    container: Container | None = None
    """The container the jobs' srun steps run in; None: on the node as it is."""
    verl_platform: Literal["gpu", "cpu"] = "gpu"
    """Where verl's trainer and generation server run: 'gpu' (vLLM or SGLang rollouts, NCCL), or
    'cpu', a test platform for clusters without GPUs (stages/engines/verl_cpu.py): gloo ranks, a
    Hugging Face rollout, and Ray counting each rank as one GPU. 'cpu' only with gpus_per_node 0."""

    @model_validator(mode="after")
    def _cpu_platform_without_gpus(self):
        if self.verl_platform == "cpu" and self.gpus_per_node:
            raise ValueError(
                "verl_platform 'cpu' is a test platform for nodes without GPUs: gpus_per_node must be 0"
            )
        return self

    @field_validator("name", "partition", "account", "qos", "time_limit")
    @classmethod
    def _plain_token(cls, value):
        if value is not None and not _DIRECTIVE_VALUE.match(value):
            raise ValueError(f"{value!r} is not a plain token usable in an #SBATCH line")
        return value

    @field_validator("constraint")
    @classmethod
    def _slurm_constraint(cls, value):
        if value is not None and not _CONSTRAINT.match(value):
            raise ValueError(f"{value!r} is not a Slurm node-feature constraint (features, & | [ ] * ( ))")
        return value

    @field_validator("extra_directives")
    @classmethod
    def _plain_directives(cls, values):
        for value in values:
            if not value.startswith("--") or not _DIRECTIVE_VALUE.match(value):
                raise ValueError(f"{value!r} is not a plain --option[=value]")
        return values

    def tasks_per_node(self) -> int:
        return self.gpus_per_node or self.ranks_per_node

    def verl_gpus_per_node(self) -> int:
        """What verl and its Ray count as a node's GPUs: the ranks, on the CPU platform."""
        return self.ranks_per_node if self.verl_platform == "cpu" else self.gpus_per_node


def load_profile(name_or_path: str, overrides: dict | None = None) -> ClusterProfile:
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES.glob("*.yaml")))
        raise ConfigError("--cluster", f"no cluster profile {name_or_path!r} (known: {known})")
    raw = {**yaml.safe_load(path.read_text()), **(overrides or {})}
    try:
        return ClusterProfile.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"{path.name}:" + ".".join(str(p) for p in err["loc"]), err["msg"]) from None


def rollout_pool_problem(rollout_gpus: int, gpus: int, gpus_per_node: int) -> str | None:
    """Why verl's separate trainer cannot place a rollout pool of `rollout_gpus` of a job's `gpus`
    (nodes of `gpus_per_node`), or None: it must leave GPUs to train on and, once the job has several
    nodes, be whole nodes (verl's resource pools are a count of GPUs on each of some nodes)."""
    if rollout_gpus >= gpus:
        return f"{rollout_gpus} of the job's {gpus} GPUs leaves none to train on"
    if gpus > gpus_per_node and rollout_gpus % gpus_per_node:
        nodes = gpus // gpus_per_node
        return (
            f"{rollout_gpus} is not whole nodes of {gpus_per_node} GPUs, which a job of {nodes} nodes needs"
        )
    return None


def rollout_span_problem(rollout_tp: int, gpus: int, gpus_per_node: int) -> str | None:
    """Why a rollout engine of `rollout_tp` GPUs cannot be laid over `gpus` GPUs of nodes of
    `gpus_per_node`, or None: an instance spans part of a node or whole nodes (verl's
    RolloutReplica needs its world size a multiple of a node's GPUs once it leaves one node), and
    the instances fill the GPUs."""
    if gpus_per_node % rollout_tp and rollout_tp % gpus_per_node:
        return f"{rollout_tp} neither divides the {gpus_per_node} GPUs of a node nor spans whole nodes"
    if gpus % rollout_tp:
        return f"{rollout_tp} does not divide the {gpus} GPUs"
    return None
