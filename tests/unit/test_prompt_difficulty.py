"""max_pass_rate: which prompts a GRPO stage keeps from their pass counts, and a clear refusal when
too few are left for a step."""

from __future__ import annotations

import pytest

from stages.data.arithmetic import generate_arithmetic
from stages.grpo.difficulty import select_prompts


def test_prompts_solved_more_often_than_the_rate_are_left_out():
    prompts = generate_arithmetic(0, 9, "prompts")
    counts = [0, 1, 2, 3, 4, 5, 6, 7, 8]  # correct answers of 8 each
    # 0.75 of 8 answers is 6: the prompts with 0..6 right stay, 7 and 8 go
    kept = select_prompts(prompts, counts, 8, 0.75, 1, "stage4_grpo.max_pass_rate")
    assert kept == prompts[:7]
    # 1.0 keeps every prompt, in order; a rate between counts rounds down to the counts it allows
    assert select_prompts(prompts, counts, 8, 1.0, 9, "f") == prompts
    assert select_prompts(prompts, counts, 8, 0.3, 1, "f") == prompts[:3]  # 2.4 of 8: 0, 1, 2


def test_too_few_prompts_left_for_a_step_is_refused_naming_the_field():
    prompts = generate_arithmetic(0, 20, "prompts")
    with pytest.raises(ValueError, match=r"stage4_grpo.max_pass_rate: only 2 of 20 prompts .* a step's 16"):
        select_prompts(prompts, [8] * 18 + [0, 3], 8, 0.5, 16, "stage4_grpo.max_pass_rate")
