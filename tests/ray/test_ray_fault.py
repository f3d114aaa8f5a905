"""Killing an engine actor mid-run: every lost request is counted and relaunched on the survivor."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

pytest.importorskip("torch")
pytest.importorskip("ray")

from episodes import TaskEpisodes  # noqa: E402

from stalebound.config import RolloutConfig, load_config  # noqa: E402
from stalebound.engines import GenerateRequest, SamplingParams  # noqa: E402
from stalebound.engines.models import load_tokenizer  # noqa: E402
from stalebound.runtime import WorkflowExecutor  # noqa: E402
from stalebound.tasks import TaskConfig, make_task  # noqa: E402


def wait_for(condition: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_killed_replica_loses_nothing_silently(ray_instance: Any, model_dir: Path) -> None:
    from stalebound.distributed import ReplicaLostError, make_ray_engine

    cfg = load_config(overrides=["engine.replicas=2", "ray.engine_num_cpus=0.25"])
    router = make_ray_engine(cfg, model_path=str(model_dir))
    task = make_task(TaskConfig(name="arithmetic"))
    samples = task.generate_samples(8, seed=1)
    episodes = TaskEpisodes(task, load_tokenizer(model_dir))
    config = RolloutConfig(consumer_batch_size=4, group_size=2, max_head_offpolicyness=1)
    try:
        with WorkflowExecutor(config, router).initialize() as ex:
            for sample in samples:
                ex.submit(sample, episodes)
            # every admitted member is on a replica: kill the first while they generate
            wait_for(lambda: sum(router.statistics().in_flight) == 16, "16 requests in flight")
            on_dead = router.statistics().in_flight[0]
            ray_instance.kill(router.engines[0].actor)
            batches = [ex.wait(4, timeout=240), ex.wait(4, timeout=240)]
            s = ex.statistics()
        rs = router.ray_statistics()
        lost = rs.lost_requests[0]
        assert rs.alive == (False, True)
        # Requests that finished before the kill landed are not lost; the rest are, each counted
        # once as a member failure and relaunched (on the survivor).
        assert 0 < lost <= on_dead
        assert dict(s.member_failures) == {"error:ReplicaLostError": lost}
        assert s.relaunched_members == lost
        assert s.completed_groups == 8 and s.failed_groups == 0
        assert s.launched_members == s.finished_members + lost + sum(s.cancelled_members.values())
        trained = [t for batch in batches for t in batch]
        assert len(trained) == 16 and all(t.staleness <= 1 for t in trained)
        assert router.statistics().routed[1] >= 8 + lost

        # With the last replica gone too, calls fail at once with the typed error.
        ray_instance.kill(router.engines[1].actor)
        request = GenerateRequest("after", (1, 5), SamplingParams(max_new_tokens=4))
        with pytest.raises(ReplicaLostError, match="ray-engine-1"):
            asyncio.run(router.agenerate(request))
        with pytest.raises(ReplicaLostError, match="no engine replica is alive"):
            asyncio.run(router.agenerate(request))
    finally:
        router.close()
