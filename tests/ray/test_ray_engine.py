"""Engine replicas as Ray actors: protocol semantics, aborts, and weights through the object store.

Two replicas serve the whole module; the test that changes weights puts the original ones back
(with a newer version).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

torch = pytest.importorskip("torch")
pytest.importorskip("ray")

from stalebound.config import load_config  # noqa: E402
from stalebound.engines import GenerateRequest, InferenceEngine, SamplingParams  # noqa: E402
from stalebound.engines.models import load_model  # noqa: E402

torch.set_num_threads(1)

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [(1, 10, 11, 12), (1, 20, 21), (1, 30, 31, 32, 33), (1, 40)]


@pytest.fixture(scope="module")
def router(ray_instance: Any, model_dir: Path) -> Iterator[Any]:
    from stalebound.distributed import make_ray_engine

    cfg = load_config(overrides=["engine.replicas=2", "ray.engine_num_cpus=0.25"])
    engine = make_ray_engine(cfg, model_path=str(model_dir))
    yield engine
    engine.close()


def reference_logprobs(model: Any, prompt: tuple[int, ...], output: tuple[int, ...]) -> list[float]:
    full = torch.tensor([[*prompt, *output]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=full).logits[0, :-1].float(), dim=-1)
    n = len(prompt)
    return [float(logp[n - 1 + i, t]) for i, t in enumerate(output)]


def generate_all(router: Any, tag: str, sampling: SamplingParams = GREEDY) -> list[Any]:
    async def run() -> list[Any]:
        requests = [GenerateRequest(f"{tag}-{i}", p, sampling) for i, p in enumerate(PROMPTS)]
        return list(await asyncio.gather(*(router.agenerate(r) for r in requests)))

    return asyncio.run(run())


def test_replicas_generate_with_raw_logprobs_and_versions(router: Any, model_dir: Path) -> None:
    assert isinstance(router, InferenceEngine)
    before = router.statistics().routed
    responses = generate_all(router, "gen")
    routed = router.statistics().routed
    assert [b - a for a, b in zip(before, routed, strict=True)] == [
        2,
        2,
    ]  # least-loaded: both replicas serve
    model = load_model(model_dir)
    for prompt, r in zip(PROMPTS, responses, strict=True):
        assert r.finish_reason == "length" and len(r.output_ids) == GREEDY.max_new_tokens
        assert r.output_versions == (router.get_version(),) * len(r.output_ids)
        ref = reference_logprobs(model, prompt, r.output_ids)
        assert r.output_logprobs == pytest.approx(ref, abs=1e-4)
        # greedy: every token is the argmax of the reference distribution
        assert max(r.output_logprobs) < 0.0


def test_abort_returns_the_partial_output(router: Any) -> None:
    long = SamplingParams(max_new_tokens=400, temperature=1.0, ignore_eos=True, seed=3)

    async def run() -> tuple[Any, Any]:
        await router.pause()  # the request cannot finish before the abort reaches it
        task = asyncio.ensure_future(router.agenerate(GenerateRequest("abort-me", (1, 5), long)))
        while router.statistics().in_flight == (0, 0):
            await asyncio.sleep(0.01)
        partial = await router.abort("abort-me")
        await router.resume()
        return partial, await task

    partial, response = asyncio.run(run())
    assert response.finish_reason == "abort" and partial == response
    assert len(response.output_ids) < long.max_new_tokens
    assert (
        len(response.output_logprobs) == len(response.output_versions) == len(response.output_ids)
    )
    assert asyncio.run(router.abort("abort-me")) is None  # finished: unknown now


def test_cancelling_a_call_aborts_it_on_the_actor(router: Any) -> None:
    long = SamplingParams(max_new_tokens=400, temperature=1.0, ignore_eos=True, seed=4)

    async def run() -> int:
        await router.pause()
        task = asyncio.ensure_future(router.agenerate(GenerateRequest("cancel-me", (1, 6), long)))
        while router.statistics().in_flight == (0, 0):
            await asyncio.sleep(0.01)
        index = router.statistics().in_flight.index(1)
        replica = router.engines[index]
        before = (await replica.statistics()).aborted
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await router.resume()
        # the abort is a separate actor call: wait for the engine to count it
        for _ in range(500):
            stats = await replica.statistics()
            if stats.aborted > before and stats.in_flight == 0:
                return int(stats.aborted - before)
            await asyncio.sleep(0.01)
        return 0

    assert asyncio.run(run()) == 1


def test_published_weights_change_outputs_and_versions_on_every_replica(
    router: Any, model_dir: Path
) -> None:
    original = load_model(model_dir).state_dict()
    start = router.get_version()
    baseline = generate_all(router, "w0")
    perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}
    asyncio.run(router.update_weights(perturbed, start + 1))
    assert router.get_version() == start + 1
    assert [e.get_version() for e in router.engines] == [start + 1, start + 1]
    changed = generate_all(router, "w1")
    assert [r.output_ids for r in changed] != [r.output_ids for r in baseline]
    assert all(set(r.output_versions) == {start + 1} for r in changed)
    # the original weights at a newer version give the original greedy outputs again
    asyncio.run(router.update_weights(original, start + 2))
    restored = generate_all(router, "w2")
    assert [r.output_ids for r in restored] == [r.output_ids for r in baseline]
    assert all(set(r.output_versions) == {start + 2} for r in restored)
    stats = router.ray_statistics()
    assert stats.weight_updates == 2 and len(stats.publish_s) == 2
    assert all(p >= q > 0 for p, q in zip(stats.publish_s, stats.put_s, strict=True))
