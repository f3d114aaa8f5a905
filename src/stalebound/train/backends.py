"""Where the main job's engines and trainer run: chosen by two small factories, not by branches.

* :func:`make_backend` (``backend``): ``local`` runs the trainer in this process and local engines
  as worker processes; ``ray`` runs both as Ray actors.
* :func:`make_engines` (``engine.kind``): ``local`` asks the backend for its local engines;
  ``vllm`` / ``sglang`` are HTTP clients of the servers at ``engine.urls``, whatever the backend.

The recipe (:class:`~stalebound.train.recipe.TrainRecipe`) talks to what they return only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from stalebound.config import StaleboundConfig

__all__ = ["Backend", "EngineSet", "check_servers", "make_backend", "make_engines"]


@dataclass
class EngineSet:
    """The engines of a run, as the recipe uses them."""

    engine: Any
    """What the workflows call (one engine, or a router over several)."""
    close: Callable[[], None] = lambda: None
    """Stops the engines this process started (worker processes, Ray actors)."""
    local: list[Any] = field(default_factory=list)
    """Local engines behind ``engine``: their ``death`` says why one died."""
    clients: list[Any] = field(default_factory=list)
    """HTTP clients: started and closed on the executor's event loop (``start`` / ``aclose``)."""
    weights_on_disk: bool = False
    """The engines reload published weights from a directory the recipe writes (servers)."""
    serves_other_weights: bool = False
    """The engines start with weights of their own (``engine.model_path`` on a server): the
    recipe publishes its policy before the first rollout."""


class Backend(Protocol):
    """Where the trainer (and local engines) run."""

    def local_engines(
        self, cfg: StaleboundConfig, model_dir: Path, version: int, step_logs: Path | None = None
    ) -> EngineSet:
        """``engine.kind: local`` engines serving ``model_dir`` at ``version``; with
        ``step_logs``, engines this process starts log their steps' costs there, one file each
        (:mod:`stalebound.engines.steplog`)."""
        ...

    def trainer(
        self,
        cfg: StaleboundConfig,
        model: Any,
        tokenizer: Any,
        policy_dir: Path,
        version: int,
        *,
        base_dir: Path | None = None,
    ) -> Any:
        """The trainer of ``model`` (at ``policy_dir``), at ``version``; ``base_dir`` holds the
        policy the run started from (what adapters are trained on)."""
        ...

    def gather(self, model: Any, trainer: Any) -> None:
        """Bring the trained weights into ``model`` (for a checkpoint or the evaluation)."""
        ...

    def close_trainer(self, trainer: Any) -> None:
        """Stop what the trainer runs on (nothing for an in-process trainer)."""
        ...


class LocalBackend:
    """The trainer in this process; local engines as worker processes behind a router."""

    def local_engines(
        self, cfg: StaleboundConfig, model_dir: Path, version: int, step_logs: Path | None = None
    ) -> EngineSet:
        from stalebound.engines.local import LocalEngine
        from stalebound.engines.router import Router

        e = cfg.engine
        engines: list[LocalEngine] = []

        def close() -> None:
            for engine in engines:
                engine.close()

        try:
            for i in range(e.replicas):
                engines.append(
                    LocalEngine(
                        model_dir,
                        version=version,
                        seed=cfg.seed + i,
                        max_batch_size=e.max_batch_size,
                        interrupt_mode=e.interrupt_mode,
                        num_threads=e.num_threads,
                        name=f"local{i}",
                        device=e.device,
                        dtype=e.dtype,
                        step_log=None if step_logs is None else step_logs / f"local{i}.jsonl",
                    )
                )
            for engine in engines:
                engine.wait_ready(timeout=300)
        except BaseException:  # one failed to start (or a second Ctrl-C): stop those that did
            close()
            raise
        if len(engines) == 1:
            return EngineSet(engines[0], close, list(engines))
        spread = Router(engines, max_in_flight_per_engine=e.max_in_flight_per_engine)
        return EngineSet(spread, close, list(engines))

    def trainer(
        self,
        cfg: StaleboundConfig,
        model: Any,
        tokenizer: Any,
        policy_dir: Path,
        version: int,
        *,
        base_dir: Path | None = None,
    ) -> Any:
        """This process's trainer, or ``train.world_size`` rank processes (``train.parallel``)."""
        from stalebound.train.parallel.settings import sharded

        if sharded(cfg):
            from stalebound.train.parallel.launch import launch_ranks

            return launch_ranks(cfg, policy_dir, pad_token_id(tokenizer), version)
        from stalebound.train.trainer import Trainer

        if cfg.train.lora.rank:
            # Adapters go on a model of the trainer's own, loaded from the run's base policy
            # (``base_dir``: on a resumed run ``policy_dir`` holds merged weights); ``model``
            # stays a plain model, into which the merged weights are gathered.
            from stalebound.engines.models import load_model

            device = str(next(model.parameters()).device)
            model = load_model(base_dir or policy_dir, device=device)
        return Trainer(model, tokenizer, cfg.train, version=version)

    def gather(self, model: Any, trainer: Any) -> None:
        """Nothing when the trainer trains ``model`` itself; the ranks' weights otherwise."""
        if getattr(trainer, "model", None) is not model:
            model.load_state_dict(dict(trainer.state_dict_for_engines()))

    def close_trainer(self, trainer: Any) -> None:
        """Stop the rank processes (an in-process trainer holds nothing to stop)."""
        close = getattr(trainer, "close", None)
        if close is not None:
            close()


class RayBackend:
    """Engine replicas and trainer ranks as Ray actors (see docs/scale-out.md)."""

    def local_engines(
        self, cfg: StaleboundConfig, model_dir: Path, version: int, step_logs: Path | None = None
    ) -> EngineSet:
        """Engine actors where Ray places them: they log no step costs (``step_logs`` is
        unused; calibration fits their engine from the trace)."""
        from stalebound.distributed import make_ray_engine

        router = make_ray_engine(cfg, model_path=str(model_dir), version=version)
        return EngineSet(router, router.close)

    def trainer(
        self,
        cfg: StaleboundConfig,
        model: Any,
        tokenizer: Any,
        policy_dir: Path,
        version: int,
        *,
        base_dir: Path | None = None,
    ) -> Any:
        from stalebound.distributed import make_ray_trainer

        return make_ray_trainer(
            cfg, policy_dir, pad_token_id=pad_token_id(tokenizer), version=version
        )

    def gather(self, model: Any, trainer: Any) -> None:
        """The ranks hold the trained weights."""
        model.load_state_dict(dict(trainer.state_dict_for_engines()))

    def close_trainer(self, trainer: Any) -> None:
        trainer.close()


def pad_token_id(tokenizer: Any) -> int:
    """The id batches are padded with: the tokenizer's pad token, else its end of sequence."""
    pad = tokenizer.pad_token_id
    return int(tokenizer.eos_token_id if pad is None else pad)


_BACKENDS: Mapping[str, Callable[[], Backend]] = {"local": LocalBackend, "ray": RayBackend}


def make_backend(cfg: StaleboundConfig) -> Backend:
    """The backend ``cfg.backend`` names."""
    return _BACKENDS[cfg.backend]()


def _http_engines(
    cfg: StaleboundConfig, backend: Backend, model_dir: Path, version: int
) -> EngineSet:
    """One client per server URL (``engine.kind`` vllm or sglang), a router over several."""
    from stalebound.engines.router import Router
    from stalebound.engines.sglang import SGLangEngine
    from stalebound.engines.vllm import VLLMEngine

    e = cfg.engine
    clients: list[Any]
    if e.kind == "sglang":
        clients = [
            SGLangEngine(url, interrupt_mode=e.interrupt_mode, seed=cfg.seed + i)
            for i, url in enumerate(e.urls)
        ]
    else:
        clients = [
            VLLMEngine(
                url,
                api="generate" if e.interrupt_mode == "continue" else "completions",
                interrupt_mode=e.interrupt_mode,
                seed=cfg.seed + i,
                weight_transfer=e.weight_transfer,
            )
            for i, url in enumerate(e.urls)
        ]
    engine = clients[0] if len(clients) == 1 else Router(clients)
    return EngineSet(
        engine,
        clients=clients,
        weights_on_disk=e.weight_transfer == "disk",
        serves_other_weights=True,
    )


_SERVER_KINDS: Mapping[str, Callable[[StaleboundConfig, Backend, Path, int], EngineSet]] = {
    "vllm": _http_engines,
    "sglang": _http_engines,
}


def check_servers(cfg: StaleboundConfig, on_wait: Callable[[str], None] | None = None) -> list[str]:
    """The problems of the servers ``engine.urls`` names (``engine.kind`` vllm or sglang): each
    must answer its health check, within ``engine.startup_timeout_s``
    (:func:`~stalebound.engines.endpoints.check_endpoints`). Blocks until then."""
    e = cfg.engine
    if e.kind not in ("vllm", "sglang"):
        return []
    from stalebound.engines.endpoints import check_endpoints

    return check_endpoints(e.urls, kind=e.kind, wait_s=e.startup_timeout_s, on_wait=on_wait)


def make_engines(
    cfg: StaleboundConfig,
    backend: Backend,
    model_dir: Path,
    version: int,
    step_logs: Path | None = None,
) -> EngineSet:
    """The engines ``cfg.engine.kind`` names: the backend's local ones (logging their steps'
    costs in ``step_logs``, where given), or HTTP clients (the servers serve
    ``engine.model_path``; the recipe publishes its weights to them)."""
    if cfg.engine.kind == "local":
        return backend.local_engines(cfg, model_dir, version, step_logs)
    return _SERVER_KINDS[cfg.engine.kind](cfg, backend, model_dir, version)
