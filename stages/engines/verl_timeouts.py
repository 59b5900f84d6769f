"""Loaded by every verl process on every platform, Ray's workers included (VERL_USE_EXTERNAL_MODULES,
stages/engines/verl_trainer.py:verl_process_env): the cluster profile's collective_timeout_s becomes
torch's default timeout of every process group. verl 0.9.1 creates its workers' group with
timeout=None (verl/workers/engine_workers.py:89) and reads its own `nccl_timeout` setting nowhere, so
each collective would wait torch's default (10 min on NCCL), less than ranks wait in the barrier
around a 70B checkpoint save."""

from runtime.dist import bound_collectives

bound_collectives()
