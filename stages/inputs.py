"""The run's inputs: the base model with its tokenizer, and the task's four data sets (SFT, prompts,
validation, held-out).

`load_task` reads (or generates) the data first, so a malformed file is reported before anything
is written; `prepare_inputs` then writes them into the run directory once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from core.atomic import atomic_write_text
from core.config import ConfigError, RunConfig, resolve_path
from core.rundir import RunDir
from stages.data.arithmetic import generate_arithmetic
from stages.data.examples import Example, read_examples, write_examples

SPLITS = ("sft", "prompts", "validation", "eval")
TINY_VOCAB_SIZE = 128  # the character tokenizer's ~110 tokens, padded so TP up to 8 divides it


def load_task(cfg: RunConfig, config_dir: Path) -> dict[str, list[Example]]:
    if cfg.data.task == "files":
        files = {split: getattr(cfg.data, f"{split}_file") for split in SPLITS}
        # No validation file: an empty validation set, and no validation accuracy.
        return {split: read_examples(resolve_path(config_dir, p)) if p else [] for split, p in files.items()}
    a = cfg.data.arithmetic
    sizes = {"sft": a.sft_size, "prompts": a.prompts_size, "eval": a.eval_size}
    sizes["validation"] = a.validation_size
    # The generator's split names: the SFT set is its "train" split.
    names = {"sft": "train", "prompts": "prompts", "validation": "validation", "eval": "eval"}
    # Only the SFT set leaves out working: the others' solutions are never trained on.
    worked = {"sft": a.worked_fraction, "prompts": 1.0, "validation": 1.0, "eval": 1.0}
    task = {}
    for split, n in sizes.items():
        try:
            task[split] = generate_arithmetic(
                cfg.seed, n, names[split], a.num_operands, a.digits, worked[split]
            )
        except ValueError as e:
            raise ConfigError(f"data.arithmetic.{split}_size", str(e)) from None
    return task


def prepare_inputs(cfg: RunConfig, run: RunDir, task: dict[str, list[Example]], config_dir: Path) -> None:
    """Write the data and the base model where they are missing or differ from what the config
    asks for now (an edited data file, another model): the stages that read them then rerun."""
    for split in SPLITS:
        path = run.task_file(split)
        if not task[split]:  # no validation file given: no validation set
            path.unlink(missing_ok=True)
            continue
        if not path.exists() or read_examples(path) != task[split]:
            write_examples(path, task[split])
    spec = json.dumps({"model": cfg.model.model_dump(mode="json"), "seed": cfg.seed}, sort_keys=True)
    if run.base_model.exists() and run.base_model_spec.is_file() and run.base_model_spec.read_text() == spec:
        return
    run.inputs.mkdir(parents=True, exist_ok=True)
    tmp = run.inputs / ".model.tmp"
    _remove(tmp)
    if cfg.model.source == "hf":
        tmp.symlink_to(resolve_path(config_dir, cfg.model.path).resolve())
    else:
        build_tiny_base(cfg, tmp)
    _remove(run.base_model)
    tmp.rename(run.base_model)
    atomic_write_text(run.base_model_spec, spec)


def validation_examples(run: RunDir, n: int) -> list[Example]:
    """The first `n` validation examples; none where the run has no validation set."""
    path = run.task_file("validation")
    return read_examples(path)[:n] if n and path.is_file() else []


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def build_tiny_base(cfg: RunConfig, out_dir: Path) -> None:
    """The tiny base model `cfg.model.tiny` and `cfg.seed` ask for, with its tokenizer, at out_dir."""
    from stages.data.tokenizer import build_char_tokenizer
    from stages.models.tiny import build_tiny_llama

    tokenizer = build_char_tokenizer(out_dir)
    build_tiny_llama(
        out_dir,
        vocab_size=TINY_VOCAB_SIZE,
        seed=cfg.seed,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **cfg.model.tiny.model_dump(),
    )
