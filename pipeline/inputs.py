"""The run's inputs: the base model with its tokenizer, and the task's three data sets.

`load_task` reads (or generates) the data first, so a malformed file is reported before anything
is written; `prepare_inputs` then writes them into the run directory once.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from pipeline.config import RunConfig, resolve_path
from pipeline.rundir import RunDir
from stages.data.arithmetic import generate_arithmetic
from stages.data.examples import Example, read_examples, write_examples

SPLITS = ("sft", "prompts", "eval")
TINY_VOCAB_SIZE = 128  # the character tokenizer's ~110 tokens, padded so TP up to 8 divides it


def load_task(cfg: RunConfig, config_dir: Path) -> dict[str, list[Example]]:
    if cfg.data.task == "files":
        files = {"sft": cfg.data.sft_file, "prompts": cfg.data.prompts_file, "eval": cfg.data.eval_file}
        return {split: read_examples(resolve_path(config_dir, path)) for split, path in files.items()}
    a = cfg.data.arithmetic
    sizes = {"sft": a.sft_size, "prompts": a.prompts_size, "eval": a.eval_size}
    # The generator's split names: the SFT set is its "train" split.
    names = {"sft": "train", "prompts": "prompts", "eval": "eval"}
    return {split: generate_arithmetic(cfg.seed, n, names[split], a.num_operands, a.digits)
            for split, n in sizes.items()}


def prepare_inputs(cfg: RunConfig, run: RunDir, task: dict[str, list[Example]], config_dir: Path) -> None:
    for split in SPLITS:
        if not run.task_file(split).exists():
            write_examples(run.task_file(split), task[split])
    if run.base_model.exists():
        return
    run.inputs.mkdir(parents=True, exist_ok=True)
    if cfg.model.source == "hf":
        run.base_model.symlink_to(resolve_path(config_dir, cfg.model.path).resolve())
        return
    tmp = run.inputs / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    _build_tiny_model(cfg, tmp)
    tmp.rename(run.base_model)


def _build_tiny_model(cfg: RunConfig, out_dir: Path) -> None:
    from stages.data.tokenizer import build_char_tokenizer
    from stages.models.tiny import build_tiny_llama

    tokenizer = build_char_tokenizer(out_dir)
    t = cfg.model.tiny
    build_tiny_llama(out_dir, vocab_size=TINY_VOCAB_SIZE, hidden_size=t.hidden_size, num_layers=t.num_layers,
                     num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, ffn_hidden_size=t.ffn_hidden_size,
                     max_position_embeddings=t.max_position_embeddings, seed=cfg.seed,
                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
