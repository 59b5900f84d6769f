"""GRPO (stage2_grpo, stage4_grpo): rollout, reward, actor and reference as separate roles, batches
carried between them as verl DataProto, advantages and losses from verl's core_algos."""
