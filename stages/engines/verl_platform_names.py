"""The names that select verl's CPU test platform, shared by the job that asks for it (verl_trainer)
and the module verl imports into each of its processes (verl_cpu), which must not import the job's
config code: every one of verl's Ray workers would pay for it."""

CPU_PLATFORM = "cpu"
CPU_ROLLOUT = "hf"  # the rollout engine stages/engines/verl_cpu.py registers
