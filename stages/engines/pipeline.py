"""One SFT step of a pipeline stage on megatron-core's 1F1B schedule.

Every rank of a data-parallel replica runs the schedule over the same micro-batches: the first
stage feeds the tokens, the last computes the loss, activations go forward and their gradients
back point to point. The schedule reports what it is doing through megatron's timer hooks
(`config.timers`); `PhaseTimers` turns those into our phases, so that the profiler files the
stage's send/recv under `pipeline_p2p` and its compute under `forward` and `backward`.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from runtime.phases import phase
from stages.data.sft_batches import MicroBatch

# megatron's timer name -> our phase. The p2p timers time a blocking exchange with the neighbours.
TIMER_PHASES = {"forward-compute": "forward", "backward-compute": "backward"}
P2P_PHASE = "pipeline_p2p"


def timer_phase(name: str) -> str | None:
    if name in TIMER_PHASES:
        return TIMER_PHASES[name]
    return P2P_PHASE if ("send" in name or "recv" in name) else None


class _PhaseTimer:
    def __init__(self, owner: PhaseTimers, name: str):
        self.owner, self.name = owner, name

    def start(self, barrier: bool = False) -> None:
        self.owner.enter(self.name)

    def stop(self, barrier: bool = False) -> None:
        self.owner.leave(self.name)


class PhaseTimers:
    """megatron-core's `timers` interface (`timers(name, log_level).start()/.stop()`), entering our
    phase for the timers named in TIMER_PHASES or P2P and ignoring the others ('forward-backward')."""

    def __init__(self):
        self._open: list[tuple[str, ExitStack]] = []

    def __call__(self, name: str, log_level: int | None = None) -> _PhaseTimer:
        return _PhaseTimer(self, name)

    def enter(self, name: str) -> None:
        if (label := timer_phase(name)) is None:
            return
        stack = ExitStack()
        stack.enter_context(phase(label))
        self._open.append((name, stack))

    def leave(self, name: str) -> None:
        if timer_phase(name) is None:
            return
        opened, stack = self._open.pop()
        if opened != name:  # phases nest: a timer stopped out of order would mislabel what follows
            raise RuntimeError(f"megatron stopped timer {name!r} while {opened!r} was running")
        stack.close()


def pipeline_step(model: torch.nn.Module, micro_batches: list[MicroBatch], device, loss_scale: float):
    """Forward and backward of every micro-batch through the pipeline; the gradients are left in
    the stage's parameters. Returns the summed token loss of the micro-batches (on the last stage;
    zero elsewhere). Micro-batches must share one shape: it is the shape of what moves between stages."""
    length, batch = micro_batches[0].input_ids.shape[1], micro_batches[0].input_ids.shape[0]
    if any(mb.input_ids.shape != (batch, length) for mb in micro_batches):
        raise ValueError("the micro-batches of a pipeline step must share one shape")

    def forward_step(data, model):
        mb = next(data).to(device)
        out = model(
            input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None, labels=mb.labels
        )

        def loss(token_losses):
            summed = (token_losses.float() * mb.loss_mask).sum()
            return summed * loss_scale, mb.loss_mask.sum().int(), summed.detach()

        return out, loss

    reduced = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=length,
        micro_batch_size=batch,
        forward_only=False,
    )
    return sum(reduced, torch.zeros((), device=device))
