"""A Hugging Face rollout engine for verl on the CPU platform (stages/engines/verl_cpu.py): what
vLLM is on a GPU, for the test clusters without one. verl 0.9.1 has server rollouts only (vLLM,
SGLang, TensorRT-LLM: workers/rollout/replica.py:388-390), so this one is registered beside them
as 'hf', with the same three parts:
- `HFReplica`: one server actor a replica, on the node of the replica's first worker;
- `HFServer`: the Ray actor that generates, token in and token out for verl's agent loop (with the
  sampled tokens' log-probs after temperature, as vLLM's "processed_logprobs"), and over HTTP as
  an OpenAI chat-completions endpoint for standalone generation;
- `HFServerAdapter`: the trainer-side adapter that sends the actor's weights to the server after
  each update (verl's "naive" weight sync: every rank reads the weights, the replica's first sends),
  or, in a rollout pool of its own, the weights the trainers broadcast (verl_gloo_weights.py).
Requests waiting together are decoded as one left-padded batch.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator

SERVER_PREFIX = "hf_server_"
MAX_BATCH = 64  # requests decoded together


def server_name(replica_rank: int, suffix: str = "") -> str:
    return f"{SERVER_PREFIX}{replica_rank}{suffix}"


@dataclass
class _Request:
    prompt_ids: list[int]
    temperature: float
    top_p: float
    max_tokens: int
    want_log_probs: bool
    generator: torch.Generator
    done: asyncio.Future = field(repr=False)


class HFServer:
    """Generates with the model at `model_config.local_path` (then with the weights the trainer sends)."""

    def __init__(self, config, model_config, rollout_mode, replica_rank: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        self.config, self.replica_rank = config, replica_rank
        path = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig).local_path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eos = {self.tokenizer.eos_token_id} | set(_as_list(self.model.generation_config.eos_token_id))
        self.eos.discard(None)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos)
        self.generator = torch.Generator().manual_seed(config.seed + replica_rank)
        self.queue: asyncio.Queue[_Request] = asyncio.Queue()
        self.decoder: asyncio.Task | None = None
        self.address, self.port = ray.util.get_node_ip_address(), None
        self.global_steps = None  # the trainer step whose weights it holds: verl tags each answer with it

    # --- token in, token out (verl's agent loop) --------------------------------------------------

    async def generate(self, prompt_ids, sampling_params: dict, request_id: str, **_) -> TokenOutput:
        room = (self.config.max_model_len or len(prompt_ids) + self.config.response_length) - len(prompt_ids)
        if room < 1:
            raise ValueError(f"a prompt of {len(prompt_ids)} tokens leaves no room within max_model_len")
        limit = (
            sampling_params.get("max_tokens")
            or sampling_params.get("max_new_tokens")
            or self.config.response_length
        )
        request = _Request(
            list(prompt_ids),
            float(sampling_params.get("temperature", 1.0)),
            float(sampling_params.get("top_p", 1.0)),
            max(1, min(int(limit), room)),
            bool(sampling_params.get("logprobs")),
            # a request's own seed, as vLLM takes it; else the server's stream
            self.generator
            if sampling_params.get("seed") is None
            else torch.Generator().manual_seed(int(sampling_params["seed"])),
            asyncio.get_running_loop().create_future(),
        )
        if self.decoder is None or self.decoder.done():
            self.decoder = asyncio.create_task(self._decode_forever())
        await self.queue.put(request)
        tokens, log_probs, finished = await request.done
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs if request.want_log_probs else None,
            stop_reason="completed" if finished else None,
            extra_fields={"global_steps": self.global_steps},
        )

    async def _decode_forever(self) -> None:
        while True:
            batch = [await self.queue.get()]
            while not self.queue.empty() and len(batch) < MAX_BATCH:
                batch.append(self.queue.get_nowait())
            try:
                results = await asyncio.to_thread(self._decode, batch)
            except Exception as e:  # the callers see it; the loop serves the next batch
                for request in batch:
                    request.done.set_exception(e)
                continue
            for request, result in zip(batch, results):
                request.done.set_result(result)

    @torch.no_grad()
    def _decode(self, batch: list[_Request]) -> list[tuple[list[int], list[float], bool]]:
        """Left-padded batched decoding with a KV cache; each row stops at EOS or its own limit."""
        from transformers import DynamicCache

        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[self.pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        temperature = torch.tensor([r.temperature for r in batch]).unsqueeze(1)
        top_p = torch.tensor([r.top_p for r in batch]).unsqueeze(1)
        limits = [r.max_tokens for r in batch]
        tokens, log_probs = [[] for _ in batch], [[] for _ in batch]
        finished = [False] * len(batch)
        cache, step_ids = DynamicCache(), ids
        for step in range(max(limits)):
            positions = (mask.cumsum(1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            logits = (
                self.model(
                    input_ids=step_ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                )
                .logits[:, -1]
                .float()
            )
            chosen, chosen_log_probs = _sample(logits, temperature, top_p, [r.generator for r in batch])
            for row, (token, log_prob) in enumerate(zip(chosen.tolist(), chosen_log_probs.tolist())):
                if finished[row] or step >= limits[row]:
                    continue
                tokens[row].append(token)
                log_probs[row].append(log_prob)
                finished[row] = token in self.eos
            if all(f or len(t) >= n for f, t, n in zip(finished, tokens, limits)):
                break
            step_ids = chosen.unsqueeze(1)
            mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=mask.dtype)], dim=1)
        return list(zip(tokens, log_probs, finished))

    # --- weights ----------------------------------------------------------------------------------

    def load_weights(self, state: dict[str, torch.Tensor], global_steps: int | None = None) -> None:
        self.global_steps = global_steps
        print(f"hf rollout on {socket.gethostname()}: the weights of step {global_steps}", flush=True)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise RuntimeError(
                f"weights do not fit the rollout model: missing {missing}, unexpected {unexpected}"
            )

    # --- HTTP (standalone generation) -------------------------------------------------------------

    async def launch_server(self) -> None:
        import uvicorn
        from fastapi import FastAPI

        app = FastAPI()
        app.post("/v1/chat/completions")(self._chat_completion)
        with socket.socket() as s:  # a free port on this node
            s.bind(("", 0))
            self.port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="0.0.0.0", port=self.port, log_level="warning"))
        self.http = asyncio.create_task(server.serve())
        while not server.started:
            if self.http.done():
                self.http.result()  # raises why it stopped
            await asyncio.sleep(0.05)

    def get_server_address(self) -> tuple[str, int]:
        return self.address, self.port

    async def _chat_completion(self, body: dict) -> dict:
        prompt_ids = self.tokenizer.apply_chat_template(
            body["messages"], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(prompt_ids, list):  # transformers 5 returns a BatchEncoding
            prompt_ids = prompt_ids["input_ids"]
        params = {k: body[k] for k in ("temperature", "top_p", "max_tokens") if body.get(k) is not None}
        output = await self.generate(prompt_ids, params, request_id=uuid.uuid4().hex)
        text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop" if output.stop_reason == "completed" else "length",
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(output.token_ids),
                "total_tokens": len(prompt_ids) + len(output.token_ids),
            },
        }

    # --- what verl's replica asks of every server: nothing to free or resume on a CPU -------------

    async def wake_up(self, tags=None):
        pass

    async def sleep(self):
        pass

    async def clear_kv_cache(self):
        pass

    async def release_kv_cache(self):
        pass

    async def resume_kv_cache(self):
        pass

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False):
        return {}

    async def resume_generation(self):
        pass

    async def start_profile(self, **kwargs):
        pass

    async def stop_profile(self):
        pass

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps


def _sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, generators: list[torch.Generator]
):
    """A token a row, and its log-probability under the distribution it was drawn from: greedy
    where the temperature is 0, else the temperature-scaled, top-p-cut softmax."""
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    cut = (cumulative - sorted_logits.softmax(-1)) >= top_p  # keep the smallest set reaching top_p
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    kept = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    log_probs = kept.log_softmax(-1)
    probs = log_probs.exp()
    drawn = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])
    chosen = torch.where(greedy.squeeze(1), scaled.argmax(-1), drawn)
    return chosen, log_probs.gather(1, chosen.unsqueeze(1)).squeeze(1)


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


class HFReplica(RolloutReplica):
    async def launch_servers(self):
        node_id = await self.workers[0].__ray_call__.remote(
            lambda worker: ray.get_runtime_context().get_node_id()
        )
        server = (
            ray.remote(HFServer)
            .options(
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False
                ),
                name=server_name(self.replica_rank, self.name_suffix),
                max_concurrency=self.max_concurrency,
            )
            .remote(self.config, self.model_config, self.rollout_mode, self.replica_rank)
        )
        await server.launch_server.remote()
        address, port = await server.get_server_address.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{address}:{port}"


class HFServerAdapter(BaseRollout):
    """In each trainer rank: passes the updated weights to its replica's server."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ["RANK"])
        size = self.config.tensor_model_parallel_size * self.config.data_parallel_size
        self.replica_rank = rank // size if replica_rank == -1 else replica_rank
        self.sends = rank % size == 0
        self.server = None

    async def resume(self, tags: list[str]):
        pass

    async def release(self):
        pass

    @torch.no_grad()
    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps=None, **kwargs):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf rollout takes whole named tensors, not {wire_format!r}")
        # Every rank reads the weights: producing each tensor is a collective of the FSDP ranks (the
        # colocated "naive" sync), or each arrives from the trainers (a rollout pool of its own).
        state = {
            name: tensor.detach().to("cpu", copy=True)
            async for name, tensor in ensure_async_iterator(weights)
        }
        if self.sends:
            self.server = self.server or ray.get_actor(server_name(self.replica_rank))
            await self.server.load_weights.remote(state, global_steps)
