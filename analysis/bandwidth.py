"""Algorithm and bus bandwidth as nccl-tests defines them (docs/design.md): S bytes moved in t seconds by
a collective over n ranks. One place for the formulas, used by the report and by commbench."""

from __future__ import annotations

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
}


def alg_bandwidth(nbytes: float, seconds: float) -> float:
    """Bytes per second."""
    return nbytes / seconds if seconds > 0 else 0.0


def bus_bandwidth(op: str, nbytes: float, seconds: float, n: int) -> float:
    """Bytes per second on the busiest link; broadcast, reduce and send/recv count S once."""
    factor = BUS_FACTOR[op](n) if op in BUS_FACTOR and n > 0 else 1.0
    return alg_bandwidth(nbytes, seconds) * factor
