"""The planner's training-memory formulas against the peak resident memory of real AdamW steps of
a Llama-shaped model on this CPU (fp32, one rank), measured in a fresh process."""

import json
import subprocess
import sys
from pathlib import Path

from analysis.memory import FP32, Layout, activations, training_states
from analysis.model_shape import LlamaShape

MODEL = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1408,
    "tie_word_embeddings": False,
}
SHAPE = LlamaShape(
    layers=8,
    hidden=512,
    heads=8,
    kv_heads=4,
    head_dim=64,
    ffn=1408,
    vocab=32000,
    tied_embeddings=False,
    rope_theta=10000.0,
    rope_scaling=None,
    file_bytes=4,
)
BATCH, SEQ = 8, 256
TOLERANCE = 0.25


def measure() -> dict:
    script = Path(__file__).with_name("measure_train_step.py")
    out = subprocess.run(
        [sys.executable, str(script), json.dumps(MODEL), str(BATCH), str(SEQ)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout)


def test_states_and_step_peaks_match_the_formulas_within_25_percent():
    measured = measure()
    assert measured["params"] == SHAPE.params()  # the formula's P is the model's own count
    states = sum(t.bytes for t in training_states(SHAPE.params(), FP32, Layout(gpus=1, tp=1, zero=0)))
    step = (
        states
        + activations(SHAPE, BATCH, SEQ, FP32.compute, tp=1, attention_scores=False, recompute=False).bytes
    )
    for name, formula in (("states_peak_bytes", states), ("step_peak_bytes", step)):
        ratio = measured[name] / formula
        print(
            f"{name}: measured {measured[name] / 1e6:.0f} MB, "
            f"formula {formula / 1e6:.0f} MB, ratio {ratio:.3f}"
        )
        assert abs(ratio - 1) <= TOLERANCE, (name, ratio)
