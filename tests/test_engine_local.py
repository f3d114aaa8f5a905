"""The local engine against a reference: the same model run with plain full forward passes.

Two worker processes serve the whole module (engine ``a`` and engine ``b``, same default model).
Tests that change ``b``'s weights put the original weights back (with a newer version).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stalebound.core.errors import ConfigError, ProtocolError  # noqa: E402
from stalebound.engines import (  # noqa: E402
    Continuation,
    EngineClosedError,
    GenerateRequest,
    MigratableEngine,
    Router,
    SamplingParams,
)
from stalebound.engines.local import LocalEngine  # noqa: E402
from stalebound.engines.models import (  # noqa: E402
    build_default_model,
    cache_keyword,
    load_model,
    load_tokenizer,
)

torch.set_num_threads(1)

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The same directory as test_engine_models.py: the second build is a cache hit.
    return build_default_model(tmp_path_factory.getbasetemp() / "default-model", seed=0)


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[tuple[LocalEngine, LocalEngine]]:
    a = LocalEngine(model_dir, name="a", seed=1)
    b = LocalEngine(model_dir, name="b", seed=2)
    try:
        a.wait_ready(120)
        b.wait_ready(120)
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    return load_model(model_dir)


@pytest.fixture(scope="module")
def prompt(model_dir: Path) -> tuple[int, ...]:
    return tuple(load_tokenizer(model_dir)("123+456=").input_ids)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@torch.inference_mode()
def greedy_full_forward(model: Any, prompt: tuple[int, ...], n: int) -> list[int]:
    """Greedy decoding without a KV cache: one full forward pass per token."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.inference_mode()
def full_forward_logprobs(model: Any, prompt: tuple[int, ...], out: tuple[int, ...]) -> list[float]:
    logits = model(torch.tensor([[*prompt, *out]])).logits[0, len(prompt) - 1 : -1]
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(1, torch.tensor(out)[:, None]).squeeze(1).tolist()


async def wait_for_tokens(engine: LocalEngine, request_id: str, count: int) -> int:
    """Wait until the request has ``count`` tokens (``None`` = not submitted yet: keep waiting)."""
    for _ in range(5000):
        done = await engine.progress(request_id)
        if done is not None and done >= count:
            return done
        await asyncio.sleep(0.002)
    raise AssertionError(f"{request_id!r} never reached {count} tokens on {engine.name!r}")


def perturbed(model: Any, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def test_engine_implements_the_migratable_protocol(
    engines: tuple[LocalEngine, LocalEngine],
) -> None:
    assert isinstance(engines[0], MigratableEngine)


def test_greedy_with_kv_cache_equals_argmax_of_full_forward_passes(
    engines: tuple[LocalEngine, LocalEngine], reference: Any, prompt: tuple[int, ...]
) -> None:
    response = run(engines[0].agenerate(GenerateRequest("greedy", prompt, GREEDY)))
    assert response.finish_reason == "length"
    assert list(response.output_ids) == greedy_full_forward(reference, prompt, 24)
    assert response.output_versions == (0,) * 24


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=30, temperature=1.3, top_p=0.8, seed=7, ignore_eos=True),
    ],
    ids=["greedy", "sampled"],
)
def test_logprobs_equal_a_recomputed_forward_pass(
    engines: tuple[LocalEngine, LocalEngine],
    reference: Any,
    prompt: tuple[int, ...],
    sampling: SamplingParams,
) -> None:
    response = run(engines[0].agenerate(GenerateRequest("lp", prompt, sampling)))
    expected = full_forward_logprobs(reference, prompt, response.output_ids)
    assert response.output_logprobs == pytest.approx(expected, abs=1e-4)


def test_stop_token_ends_the_sequence_and_is_included(
    engines: tuple[LocalEngine, LocalEngine], reference: Any, prompt: tuple[int, ...]
) -> None:
    full = greedy_full_forward(reference, prompt, 24)
    stop = full[5]
    sampling = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(stop,))
    response = run(engines[0].agenerate(GenerateRequest("stop", prompt, sampling)))
    assert response.finish_reason == "stop"
    assert list(response.output_ids) == full[: full.index(stop) + 1]


def test_continuous_batching_matches_one_at_a_time(
    engines: tuple[LocalEngine, LocalEngine], model_dir: Path
) -> None:
    tok = load_tokenizer(model_dir)
    texts = ["1+1=", "abc", "reverse: hello", "99*7=", "x", "The quick brown fox", "(a,b)", "0"]
    # the first request is the longest: it is still decoding when each later one joins
    lengths = [300, *(6 + 5 * i for i in range(1, len(texts)))]
    requests = [
        GenerateRequest(
            f"cb{i}",
            tuple(tok(text).input_ids),
            SamplingParams(
                max_new_tokens=lengths[i],
                temperature=0.0 if i % 2 == 0 else 1.0,
                seed=100 + i,
                ignore_eos=True,
            ),
        )
        for i, text in enumerate(texts)
    ]
    engine = engines[0]

    async def one_at_a_time() -> list[Any]:
        return [await engine.agenerate(r) for r in requests]

    async def staggered() -> tuple[list[Any], list[int]]:
        tasks, joined_at = [], []
        try:
            for r in requests:  # each joins while the engine is paused between two tokens
                await engine.pause()
                tasks.append(asyncio.create_task(engine.agenerate(r)))
                await wait_for_tokens(engine, r.request_id, 0)  # in the worker, not admitted
                done = await engine.progress(requests[0].request_id)
                joined_at.append(-1 if done is None else done)
                await engine.resume()
                await wait_for_tokens(engine, r.request_id, 1)  # prefilled into the batch
        finally:
            await engine.resume()
        return list(await asyncio.gather(*tasks)), joined_at

    alone = run(one_at_a_time())
    together, joined_at = run(staggered())
    # every later request joined while the first was mid-decode (0 < tokens < 300)
    assert all(0 < n < lengths[0] for n in joined_at[1:]), joined_at
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    for x, y in zip(together, alone, strict=True):
        assert x.output_logprobs == pytest.approx(y.output_logprobs, abs=1e-4)


def test_abort_returns_the_partial_output(
    engines: tuple[LocalEngine, LocalEngine], reference: Any, prompt: tuple[int, ...]
) -> None:
    engine = engines[0]
    sampling = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)

    async def scenario() -> tuple[Any, Any, Any]:
        task = asyncio.create_task(engine.agenerate(GenerateRequest("ab", prompt, sampling)))
        await asyncio.sleep(0)
        assert await wait_for_tokens(engine, "ab", 3) >= 3
        await engine.pause()  # the abort lands between two tokens, before the request can end
        try:
            partial = await engine.abort("ab")
            again = await engine.abort("ab")
        finally:
            await engine.resume()
        return partial, await task, again

    partial, returned, again = run(scenario())
    assert partial is not None and partial.finish_reason == "abort"
    assert returned == partial
    assert again is None
    n = len(partial.output_ids)
    assert 3 <= n < 400
    assert list(partial.output_ids) == greedy_full_forward(reference, prompt, n)
    assert engine.statistics().aborted >= 1


def test_cancelling_agenerate_stops_the_request_in_the_worker(
    engines: tuple[LocalEngine, LocalEngine], prompt: tuple[int, ...]
) -> None:
    engine = engines[0]
    sampling = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)

    async def scenario() -> tuple[int, int]:
        before = engine.statistics().output_tokens
        task = asyncio.create_task(engine.agenerate(GenerateRequest("cancel", prompt, sampling)))
        await asyncio.sleep(0)
        await wait_for_tokens(engine, "cancel", 2)
        await engine.pause()  # the cancellation reaches the worker before the request can end
        try:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(1000):  # the worker's abort arrives asynchronously
                if engine.num_in_flight == 0:
                    break
                await asyncio.sleep(0.005)
        finally:
            await engine.resume()
        return engine.num_in_flight, engine.statistics().output_tokens - before

    in_flight, generated = run(scenario())
    assert in_flight == 0
    assert 2 <= generated < 400  # stopped early, not run to max_new_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_migrated_request_continues_exactly(
    engines: tuple[LocalEngine, LocalEngine], prompt: tuple[int, ...], temperature: float
) -> None:
    a, b = engines
    sampling = SamplingParams(max_new_tokens=60, temperature=temperature, seed=3, ignore_eos=True)
    request = GenerateRequest(f"mig{temperature}", prompt, sampling)

    async def scenario() -> tuple[Any, Any, Continuation]:
        uninterrupted = await b.agenerate(request)
        task = asyncio.create_task(a.agenerate(request))
        await asyncio.sleep(0)
        assert await wait_for_tokens(a, request.request_id, 5) >= 5
        await a.pause()  # exported between two tokens, before the request can end
        try:
            continuation = await a.export_continuation(request.request_id)
        finally:
            await a.resume()
        assert continuation is not None
        source_result = await task
        assert source_result.finish_reason == "abort"
        assert source_result.output_ids == continuation.output_ids
        return uninterrupted, await b.acontinue(continuation), continuation

    uninterrupted, migrated, continuation = run(scenario())
    assert 5 <= len(continuation.output_ids) < 60
    assert migrated.output_ids == uninterrupted.output_ids
    assert migrated.output_logprobs == pytest.approx(uninterrupted.output_logprobs, abs=1e-4)
    assert migrated.output_ids[: len(continuation.output_ids)] == continuation.output_ids


def _update_mid_request(
    engine: LocalEngine, prompt: tuple[int, ...], state: dict[str, Any], mode: str
) -> tuple[Any, int, int]:
    sampling = SamplingParams(max_new_tokens=80, temperature=0.0, ignore_eos=True)

    async def scenario() -> tuple[Any, int, int]:
        old = engine.get_version()
        task = asyncio.create_task(
            engine.agenerate(GenerateRequest(f"up-{mode}", prompt, sampling))
        )
        await asyncio.sleep(0)
        await wait_for_tokens(engine, f"up-{mode}", 4)
        await engine.pause()  # no token is generated while paused: the split point is exact
        k = await engine.progress(f"up-{mode}")
        assert k is not None
        await engine.update_weights(state, old + 1, interrupt_mode=mode)  # type: ignore[arg-type]
        await engine.resume()
        return await task, k, old

    result: tuple[Any, int, int] = run(scenario())
    return result


@torch.inference_mode()
def test_versions_change_exactly_at_the_update_point(
    engines: tuple[LocalEngine, LocalEngine],
    reference: Any,
    prompt: tuple[int, ...],
    model_dir: Path,
) -> None:
    engine = engines[1]
    new = load_model(model_dir)
    new.load_state_dict(perturbed(reference, seed=11))
    try:
        response, k, old = _update_mid_request(engine, prompt, new.state_dict(), "continue")
    finally:
        run(engine.update_weights(reference.state_dict(), engine.get_version() + 1))
    n = len(response.output_ids)
    assert 4 <= k < n == 80
    assert response.output_versions == (old,) * k + (old + 1,) * (n - k)
    out = list(response.output_ids)
    assert out[:k] == greedy_full_forward(reference, prompt, k)
    # Partial rollout: the new weights continue on top of the KV cache the old weights computed.
    keyword = cache_keyword(reference)
    cache = getattr(reference(torch.tensor([[*prompt, *out[: k - 1]]]), use_cache=True), keyword)
    expected, logprobs, token = [], [], out[k - 1]
    for _ in range(n - k):
        logits = new(torch.tensor([[token]]), use_cache=True, **{keyword: cache}).logits[0, -1]
        token = int(logits.argmax())
        expected.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
    assert out[k:] == expected
    assert response.output_logprobs[k:] == pytest.approx(logprobs, abs=1e-4)
    assert engine.statistics().pause_ms


@torch.inference_mode()
def test_resubmit_mode_recomputes_with_the_new_weights(
    engines: tuple[LocalEngine, LocalEngine],
    reference: Any,
    prompt: tuple[int, ...],
    model_dir: Path,
) -> None:
    engine = engines[1]
    new = load_model(model_dir)
    new.load_state_dict(perturbed(reference, seed=12))
    try:
        response, k, old = _update_mid_request(engine, prompt, new.state_dict(), "resubmit")
    finally:
        run(engine.update_weights(reference.state_dict(), engine.get_version() + 1))
    n = len(response.output_ids)
    assert 4 <= k < n
    assert response.resubmits == 1
    assert response.output_versions == (old,) * k + (old + 1,) * (n - k)
    out = list(response.output_ids)
    assert out[:k] == greedy_full_forward(reference, prompt, k)
    assert out[k:] == greedy_full_forward(new, (*prompt, *out[:k]), n - k)
    assert response.output_logprobs[k:] == pytest.approx(
        full_forward_logprobs(new, (*prompt, *out[:k]), tuple(out[k:])), abs=1e-4
    )


def test_bad_weights_are_rejected_and_change_nothing(
    engines: tuple[LocalEngine, LocalEngine], reference: Any, prompt: tuple[int, ...]
) -> None:
    engine = engines[1]
    version = engine.get_version()
    state = dict(reference.state_dict())
    state.pop("lm_head.weight")
    with pytest.raises(ProtocolError, match=r"missing=\['lm_head.weight'\]"):
        run(engine.update_weights(state, version + 1))
    with pytest.raises(ProtocolError, match="versions never go backwards"):
        run(engine.update_weights(reference.state_dict(), version - 1))
    assert engine.get_version() == version
    response = run(engine.agenerate(GenerateRequest("after-bad", prompt, GREEDY)))
    assert list(response.output_ids) == greedy_full_forward(reference, prompt, 24)


def test_bad_requests_fail_clearly(
    engines: tuple[LocalEngine, LocalEngine], prompt: tuple[int, ...]
) -> None:
    engine = engines[0]
    with pytest.raises(ProtocolError, match="outside the vocabulary"):
        run(engine.agenerate(GenerateRequest("oov", (1, 100_000), GREEDY)))
    with pytest.raises(ProtocolError, match="split_n"):
        run(engine.agenerate(GenerateRequest("n2", prompt, SamplingParams(n=2))))
    with pytest.raises(ProtocolError, match="shorten the prompt"):
        run(engine.agenerate(GenerateRequest("long", (5,) * 600, GREEDY)))

    async def duplicate() -> None:
        long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
        task = asyncio.create_task(engine.agenerate(GenerateRequest("dup", prompt, long)))
        await asyncio.sleep(0)
        try:
            with pytest.raises(ProtocolError, match="already in flight"):
                await engine.agenerate(GenerateRequest("dup", prompt, long))
        finally:
            await engine.abort("dup")
            await task

    run(duplicate())

    # A message that cannot be pickled fails its own call; the engine goes on.
    class Unpicklable(int):
        def __reduce_ex__(self, protocol: Any) -> Any:
            raise TypeError("not picklable")

    with pytest.raises(ProtocolError, match="'submit' message could not be sent"):
        run(engine.agenerate(GenerateRequest("bad", (*prompt, Unpicklable(5)), GREEDY)))
    after = run(engine.agenerate(GenerateRequest("after", prompt, GREEDY)))
    assert after.num_output_tokens == GREEDY.max_new_tokens
    with pytest.raises(ConfigError, match=r"no config\.json"):
        LocalEngine(os.devnull)


def test_router_prefers_the_least_loaded_replica_and_migrates(
    engines: tuple[LocalEngine, LocalEngine], prompt: tuple[int, ...]
) -> None:
    router = Router(engines)
    long = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)

    async def scenario() -> tuple[Any, Any, Any]:
        before = [e.statistics().submitted + e.statistics().migrated_in for e in engines]
        t1 = asyncio.create_task(router.agenerate(GenerateRequest("r1", prompt, long)))
        await asyncio.sleep(0)
        t2 = asyncio.create_task(router.agenerate(GenerateRequest("r2", prompt, long)))
        await asyncio.sleep(0)
        placed = router.statistics().in_flight
        await wait_for_tokens(engines[0], "r1", 3)
        await engines[0].pause()  # r1 moves between two tokens, before it can end
        try:
            assert await router.migrate("r1", to=1)
        finally:
            await engines[0].resume()
        r1, r2 = await asyncio.gather(t1, t2)
        after = [e.statistics().submitted + e.statistics().migrated_in for e in engines]
        return placed, (r1, r2), [x - y for x, y in zip(after, before, strict=True)]

    placed, (r1, r2), delta = run(scenario())
    assert placed == (1, 1)
    assert delta == [1, 2]  # r1 on a; r2 on b; r1's continuation on b
    assert r1.finish_reason == r2.finish_reason == "length"
    assert r1.output_ids == r2.output_ids  # same prompt, greedy: migration changed nothing
    assert router.statistics().in_flight == (0, 0)
    assert router.statistics().migrations == 1


def test_closed_engine_fails_pending_and_new_calls(
    model_dir: Path, prompt: tuple[int, ...]
) -> None:
    engine = LocalEngine(model_dir, name="short-lived")

    async def scenario() -> None:
        engine.wait_ready(120)
        await engine.pause()  # the request reaches the worker and stays there, unfinished
        task = asyncio.create_task(engine.agenerate(GenerateRequest("p", prompt, GREEDY)))
        assert await wait_for_tokens(engine, "p", 0) == 0
        await engine.aclose()
        with pytest.raises(EngineClosedError, match="closed"):
            await task
        with pytest.raises(EngineClosedError, match="create a new LocalEngine"):
            await engine.agenerate(GenerateRequest("q", prompt, GREEDY))

    run(scenario())
    assert engine.closed


def _count_decode_passes(model: Any) -> list[tuple[int, int]]:
    """The (rows, cache width) of every decode pass ``model`` runs from now on."""
    passes: list[tuple[int, int]] = []
    forward = model.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get(cache_keyword(model))
        if cache is not None and kwargs["input_ids"].shape[1] == 1:
            passes.append((kwargs["input_ids"].shape[0], cache.get_seq_length() + 1))
        return forward(*args, **kwargs)

    model.forward = counted
    return passes


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_a_long_straggler_decodes_apart_from_the_short_rows(model_dir: Path) -> None:
    """The worker in this process: one request with a long context beside 16 short ones. The
    short rows are not padded to the straggler's cache (a decode step attends to about the
    slots the rows need, in two passes), the straggler joins them once few are left, and every
    request generates what it generates alone."""
    from stalebound.engines._worker import Worker
    from stalebound.engines.cohorts import COHORT_PADDING_SLOTS

    model = load_model(model_dir)
    passes = _count_decode_passes(model)
    long_prompt = tuple(5 + i % 50 for i in range(200))
    requests = [
        GenerateRequest("long", long_prompt, SamplingParams(max_new_tokens=40, ignore_eos=True)),
        *(
            GenerateRequest(
                f"short{i}",
                tuple(5 + (i + j) % 50 for j in range(4 + i % 4)),  # prompts of 4 to 7 tokens
                SamplingParams(max_new_tokens=30 if i == 0 else 10, ignore_eos=True),
            )
            for i in range(16)
        ),
    ]

    def generate(
        batch: list[GenerateRequest],
    ) -> tuple[dict[str, Any], list[list[tuple[int, int]]]]:
        worker = Worker(model, version=0, max_batch_size=64, interrupt_mode="continue")
        for r in batch:
            worker.submit(Continuation(r), seed=7)
        out: dict[str, Any] = {}
        steps = []
        while worker.has_work():
            passes.clear()
            worker.step()
            steps.append(list(passes))
            out.update((r.request_id, r) for r in worker.take_finished())
        return out, steps

    together, steps = generate(requests)
    # each row's own cache: its context so far (prompt + tokens before this step's input)
    for t, step in enumerate(steps[1:9], start=1):
        needed = 200 + t + sum(4 + i % 4 + t for i in range(16))
        assert sum(rows * width for rows, width in step) <= needed + COHORT_PADDING_SLOTS, step
        assert len(step) == 2, step
    assert all(len(step) == 1 for step in steps[11:]), steps[11:]  # 2 rows left: one pass
    for r in requests:
        alone, _ = generate([r])
        assert together[r.request_id].output_ids == alone[r.request_id].output_ids
        assert together[r.request_id].output_logprobs == pytest.approx(
            alone[r.request_id].output_logprobs, abs=1e-4
        )


def test_the_worker_logs_what_its_steps_attend(model_dir: Path, tmp_path: Path) -> None:
    """With a step log, the worker's windows add up to the forward passes it ran: the passes,
    the rows and the cache positions of every decode pass, and each request admitted once."""
    from stalebound.engines._worker import Worker
    from stalebound.engines.steplog import StepLog, read_step_logs

    model = load_model(model_dir)
    passes = _count_decode_passes(model)
    log = StepLog(tmp_path / "steps" / "w.jsonl", window=0.0)  # a line per step
    worker = Worker(model, version=0, max_batch_size=8, interrupt_mode="continue", step_log=log)
    for i in range(12):  # more than a batch: 4 wait for room
        prompt = tuple(5 + (i + j) % 50 for j in range(3 + i % 5))
        sampling = SamplingParams(max_new_tokens=4 + 3 * i, ignore_eos=True)
        worker.submit(Continuation(GenerateRequest(f"r{i}", prompt, sampling)), seed=1)
    steps = 0
    while worker.has_work():
        worker.step()
        steps += 1
    log.close()
    windows = read_step_logs(tmp_path / "steps")["w"]
    total = {k: sum(w[k] for w in windows) for k in windows[0]}
    assert total["admitted"] == 12
    assert total["steps"] == steps
    assert total["passes"] == len(passes)
    assert total["rows"] == sum(rows for rows, _ in passes)
    assert total["slots"] == sum(rows * width for rows, width in passes)
    assert 0 < total["context_slots"] < total["slots"]
    assert total["decode_s"] > 0 and total["admit_s"] > 0
