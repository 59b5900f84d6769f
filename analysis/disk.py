"""What a run writes into its run directory, stage by stage: what `hpcr1 submit` holds the free space
and inodes of the run directory's file system against before it queues anything.

A stage keeps `keep_checkpoints` step checkpoints and writes the next one before it prunes the
oldest, so keep + 1 are on disk at its peak; a finished stage keeps its checkpoints and its final/
(pipeline/driver.py never removes them). Per parameter (P), a checkpoint holds:
- SFT (DeepSpeed over megatron-core): the weights in the stage's dtype, Adam's two moments in fp32,
  and, but for fp32 without ZeRO, DeepSpeed's fp32 master partitions (its ZeRO and bf16 optimizers
  save them beside the moments);
- GRPO, native (torch DCP): the fp32 master weights and Adam's two moments: 12 bytes;
- GRPO on verl: the same (its FSDP keeps fp32 parameters; megatron's distributed optimizer the
  bf16 weights beside fp32 main weights and moments: 14 bytes);
and final/ the model in its dtype (safetensors). Synthesis writes data only: a record a response.
Step metrics, rank logs and communication profiles are small beside these and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import GRPOStage, RunConfig, SFTStage, SynthStage

ADAM_MOMENTS = 8  # two fp32 moments a parameter
# Bytes a synthesised response takes in the stage's data (its JSON record: prompt, response, answer)
SYNTH_RECORD_BYTES = 2048
# Files a checkpoint holds a rank, at most, and those a checkpoint holds once (checksums, state)
FILES_PER_RANK, FILES_PER_CHECKPOINT = 6, 4


@dataclass(frozen=True)
class StageDisk:
    stage: str
    checkpoint_bytes: int
    """One step checkpoint."""
    checkpoints: int
    """Checkpoints on disk at the stage's peak: those kept and the one being written."""
    final_bytes: int
    """final/ (or the synthesised data)."""
    files: int
    """Files (inodes) the stage leaves, at its peak."""

    @property
    def total_bytes(self) -> int:
        return self.checkpoint_bytes * self.checkpoints + self.final_bytes


def run_disk(cfg: RunConfig, params: int, on_gpu: bool, stages: list[str] | None = None) -> list[StageDisk]:
    """Each of `stages` (default: all) as it will be written; `on_gpu`: 'auto' dtypes resolve to bf16."""
    return [
        stage_disk(sid, stage, params, on_gpu, cfg.nproc)
        for sid, stage in cfg.stages().items()
        if stages is None or sid in stages
    ]


def stage_disk(sid: str, stage, params: int, on_gpu: bool, ranks: int) -> StageDisk:
    files = FILES_PER_RANK * ranks + FILES_PER_CHECKPOINT
    if isinstance(stage, SynthStage):
        data = stage.num_prompts * stage.max_per_prompt * SYNTH_RECORD_BYTES
        return StageDisk(sid, 0, 0, data, files)
    kept = stage.keep_checkpoints + 1
    if isinstance(stage, SFTStage):
        weight = 2 if stage.dtype == "bf16" else 4
        master = 0 if stage.dtype == "fp32" and stage.parallel.zero_stage == 0 else 4
        return StageDisk(sid, params * (weight + master + ADAM_MOMENTS), kept, params * weight, files * kept)
    assert isinstance(stage, GRPOStage)
    bf16 = stage.dtype == "bf16" or (stage.dtype == "auto" and on_gpu)
    megatron = stage.engine == "verl" and stage.verl.backend == "megatron"
    per_param = 4 + ADAM_MOMENTS + (2 if megatron else 0)
    return StageDisk(sid, params * per_param, kept, params * (2 if bf16 else 4), files * kept)
