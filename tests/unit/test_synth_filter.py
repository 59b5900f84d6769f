"""Rejection sampling's selection: distinct responses only, at most N per prompt, in sample order."""

from __future__ import annotations

from stages.synth import Candidate, keep_distinct


def test_keeps_first_distinct_responses_up_to_the_cap_per_prompt():
    candidates = [
        Candidate(1, 3, "c", 1.1),
        Candidate(0, 2, "b", 1.1),
        Candidate(0, 0, "a", 1.1),
        Candidate(0, 1, "a", 1.1),
        Candidate(0, 3, "d", 1.1),
        Candidate(1, 0, "a", 1.1),
    ]
    kept = keep_distinct(candidates, max_per_prompt=2)
    assert [(c.prompt_index, c.sample_index, c.response) for c in kept] == [
        (0, 0, "a"),
        (0, 2, "b"),
        (1, 0, "a"),
        (1, 3, "c"),
    ]


def test_same_response_to_different_prompts_is_not_a_duplicate():
    kept = keep_distinct([Candidate(0, 0, "x", 1.1), Candidate(1, 0, "x", 1.1)], max_per_prompt=1)
    assert len(kept) == 2
