"""Paths of the run directory (docs/design.md, "The run directory"): one place that knows the layout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def lock(self) -> Path:
        """Held (flock) by the one `hpcr1 run`/`resume` working on this directory; names it."""
        return self.root / "run.lock"

    @property
    def inputs(self) -> Path:
        """The base model (with its tokenizer) and the task's data, prepared once per run."""
        return self.root / "inputs"

    @property
    def base_model(self) -> Path:
        return self.inputs / "model"

    @property
    def base_model_digests(self) -> Path:
        """The sha256 of each base model file with the stat it was read at (pipeline/fingerprint.py)."""
        return self.inputs / "model.sha256.json"

    @property
    def base_model_spec(self) -> Path:
        """The model section (and seed) inputs/model was made from: another one remakes it."""
        return self.inputs / "model.json"

    def task_file(self, split: str) -> Path:
        """split: sft, prompts, validation or eval (held-out)."""
        return self.inputs / "data" / f"{split}.jsonl"

    def stage(self, stage_id: str) -> Path:
        return self.root / stage_id

    def ckpt(self, stage_id: str) -> Path:
        return self.stage(stage_id) / "ckpt"

    def final(self, stage_id: str) -> Path:
        return self.stage(stage_id) / "final"

    def metrics(self, stage_id: str) -> Path:
        return self.stage(stage_id) / "metrics.jsonl"

    def profile(self, stage_id: str) -> Path:
        return self.stage(stage_id) / "profile"

    def logs(self, stage_id: str) -> Path:
        return self.stage(stage_id) / "logs"

    def nccl_inspector(self, stage_id: str) -> Path:
        """Where NCCL Inspector's dumps of the stage go when the user points NCCL_INSPECTOR_DUMP_DIR
        here (docs/design.md, "Communication events"); nothing of ours writes it."""
        return self.stage(stage_id) / "nccl-inspector"

    def synthetic_data(self, stage_id: str) -> Path:
        """The JSONL a synthesis stage writes (with provenance), read by the SFT stage after it."""
        return self.stage(stage_id) / "data" / "synthetic.jsonl"

    def synthesis_batches(self, stage_id: str) -> Path:
        """A synthesis stage's sampled batches, one record each (stages/kept.py): what a preempted
        attempt keeps, so that the next one samples only the others."""
        return self.stage(stage_id) / "batches"

    def prompt_selection(self, stage_id: str) -> Path:
        """A GRPO stage's pass counts of its prompts (max_pass_rate), kept for its later attempts."""
        return self.stage(stage_id) / "prompt_selection.json"

    def training_data(self, stage_id: str) -> Path:
        """What an SFT stage made of its examples (how many max_seq_len truncated, or why it refused
        to train), written by its rank 0 before training and picked up into the manifest."""
        return self.stage(stage_id) / "training_data.json"

    def eval_result(self, stage_id: str) -> Path:
        """Held-out accuracy the stage's ranks measured on final/, picked up into the manifest."""
        return self.stage(stage_id) / "eval.json"

    def wandb_run(self, stage_id: str) -> tuple[str, str]:
        """(name, id) of the stage's wandb run: one run for all its attempts, which resume it."""
        name = f"{self.root.name}/{stage_id}"
        return name, name.replace("/", "-")

    def model_dir(self, source: str) -> Path:
        """Where a stage's starting model lives: 'base' or an earlier stage's final/."""
        return self.base_model if source == "base" else self.final(source)
