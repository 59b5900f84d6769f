"""Generation on verl's rollout replicas, for synthesis and held-out eval on verl: the replicas verl's
`main_generation_server` starts (vLLM, SGLang, or the CPU platform's HF), asked the way verl's own
trainer asks them, token in and token out through their Ray handles. What differs from
main_generation_server, which sends every request at once, one HTTP session each, with no timeout
(verl/trainer/main_generation_server.py:66-100): at most `in_flight` requests a replica at a time,
each bounded by `timeout_s`, so a synthesis of tens of thousands of answers opens no sockets and a
dead or hung replica fails the job naming it instead of holding it to its time limit.

    python -m stages.engines.verl_generate ENV_JSON IN_FLIGHT TIMEOUT_S SAMPLED_JSON OVERRIDES...

OVERRIDES are verl's `ppo_trainer` config as stages/engines/verl_generation.py writes them (prompts
in `data.train_files`, answers to `data.output_path`); ENV_JSON the environment verl's actors need.
SAMPLED_JSON: null, or {"n": k, "temperature": t}: k more answers a prompt sampled at t by the same
replicas (held-out eval's mean@k beside its greedy answers), into a second column.
"""

from __future__ import annotations

import asyncio
import json
import sys

from stages.engines.verl_generation import RESPONSES, SAMPLED_RESPONSES
from stages.engines.verl_trainer import compose_verl_config


async def generate_all(
    servers: list, addresses: list[str], prompts: list[list[int]], n: int, sampling: dict, seed: int,
    in_flight: int, timeout_s: float,
):  # fmt: skip
    """`n` answers (token ids) a prompt from the replicas' servers (Ray handles) at `addresses`;
    answer j of prompt i goes to replica (i*n + j) mod count, sampled with its own seed (an engine
    seeds every request alike unless told)."""
    from tqdm import tqdm

    gates = [asyncio.Semaphore(in_flight) for _ in servers]
    progress = tqdm(total=len(prompts) * n, desc="generation", unit="answer", file=sys.stderr, mininterval=5)

    async def one(index: int, prompt_ids: list[int]) -> list[int]:
        replica = index % len(servers)
        async with gates[replica]:
            ref = servers[replica].generate.remote(
                prompt_ids=prompt_ids,
                sampling_params={**sampling, "seed": seed + index},
                request_id=f"hpcr1-{index}",
            )
            try:
                output = await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
            except TimeoutError:
                import ray

                ray.cancel(ref)
                raise TimeoutError(
                    f"the rollout replica at {addresses[replica]} did not answer a request within "
                    f"{timeout_s:g} s (request_timeout_s)"
                ) from None
        progress.update()
        return output.token_ids

    try:
        answers = await asyncio.gather(*(one(i * n + j, p) for i, p in enumerate(prompts) for j in range(n)))
    finally:
        progress.close()
    return [answers[i * n : (i + 1) * n] for i in range(len(prompts))]


def main(argv: list[str]) -> int:
    import pandas as pd
    import ray
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    env, in_flight, timeout_s = json.loads(argv[0]), int(argv[1]), float(argv[2])
    sampled, overrides = json.loads(argv[3]), argv[4:]
    config = compose_verl_config(overrides)
    OmegaConf.resolve(config)
    rollout = config.actor_rollout_ref.rollout
    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    table = pd.read_parquet(config.data.train_files)
    prompts = [_chat_ids(tokenizer, list(messages)) for messages in table[config.data.prompt_key]]
    sampling = {
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "max_tokens": rollout.response_length,
    }
    # verl's own start-up of the replicas (it sets two tokenizer/NCCL variables when imported)
    from verl.trainer.main_generation_server import start_server

    ray.init(runtime_env={"env_vars": env}, logging_level="ERROR")
    passes = [(RESPONSES, rollout.n, sampling)]
    if sampled:
        passes.append((SAMPLED_RESPONSES, sampled["n"], {**sampling, "temperature": sampled["temperature"]}))
    seed = rollout.seed
    try:
        servers, addresses = asyncio.run(start_server(config))
        for column, n, params in passes:
            answers = asyncio.run(
                generate_all(servers, addresses, prompts, n, params, seed, in_flight, timeout_s)
            )
            seed += len(prompts) * n  # the next pass's seeds follow: no two requests share one
            table[column] = [[tokenizer.decode(a, skip_special_tokens=True) for a in row] for row in answers]
            print(f"{len(answers)} prompts x {n} answers -> {config.data.output_path} ({column})", flush=True)
    finally:
        ray.shutdown()
    table.to_parquet(config.data.output_path)
    return 0


def _chat_ids(tokenizer, messages: list) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
