"""The discrete-event simulator: the core's staleness policies on a virtual clock.

* :func:`simulate` / :class:`Simulation` — one policy at one η on one seeded workload.
* :class:`WorkloadConfig` and :func:`load_preset` / :func:`load_workload` — the modelled cluster.
* :class:`TraceRecorder` / :func:`read_trace` / :class:`ReplaySource` — rollout traces.

``stalebound simulate`` (``stalebound.sim.cli``) runs several policies side by side; see
``docs/simulator.md``.
"""

from stalebound.obs.trace import TraceHeader, TraceRecorder, TrajectoryRecord, read_trace
from stalebound.sim.config import WorkloadConfig, list_presets, load_preset, load_workload
from stalebound.sim.replay import ReplaySource
from stalebound.sim.simulator import POLICIES, Bound, SimResult, Simulation, compute_bound, simulate

__all__ = [
    "POLICIES",
    "Bound",
    "ReplaySource",
    "SimResult",
    "Simulation",
    "TraceHeader",
    "TraceRecorder",
    "TrajectoryRecord",
    "WorkloadConfig",
    "compute_bound",
    "list_presets",
    "load_preset",
    "load_workload",
    "read_trace",
    "simulate",
]
