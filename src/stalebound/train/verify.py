"""A checkpoint read whole and checked before a resume changes anything.

:func:`~stalebound.train.checkpoint.open_checkpoint` checks a checkpoint's files against its
manifest (sizes, digests, nothing unlisted, no weights but safetensors). :func:`verify_checkpoint`
then reads every file as what it should hold, the way the resumed run will use it, and checks it
fits the run:

* the policy: ``config.json`` builds the model's shape (on PyTorch's ``meta`` device: no weights
  are allocated), the tokenizer loads, and every ``*.safetensors`` file parses and holds exactly
  the model's tensors, each of its shape;
* ``trainer_state.pt``: loaded with ``weights_only=True``; the optimizer's state belongs to
  those parameters (their number, each state tensor of its parameter's shape), the RNG states
  are states the generators take;
* ``rollout_state.json``: parsed with a depth limit, its ``$type`` tags decoded, and loaded into a
  throwaway coordinator of the run's settings (the core is pure, so this touches nothing else);
* ``job_state.json``: parsed (its fields are checked by the job).

A problem raises :class:`~stalebound.train.checkpoint.CheckpointError` naming the file, what is
wrong and the checkpoint to resume from instead, before the caller has written anything.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

from stalebound.core import ConfigError, StaleboundError
from stalebound.train.checkpoint import ROLLOUT_STATE, TRAINER_STATE, Checkpoint, error_text

__all__ = [
    "IGNORED_ON_RESUME",
    "VerifiedCheckpoint",
    "ignored_on_resume",
    "run_dir_problem",
    "verify_checkpoint",
]


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A checkpoint whose files were all read and checked (:func:`verify_checkpoint`), with the
    states a resumed run loads."""

    checkpoint: Checkpoint
    trainer_state: Mapping[str, Any]
    rollout_state: Mapping[str, Any]
    job_state: Mapping[str, Any]


def verify_checkpoint(checkpoint: Checkpoint, rollout: Any) -> VerifiedCheckpoint:
    """Read and check every file of ``checkpoint`` (see the module docstring) for a run whose
    rollout section is ``rollout``; raises :class:`CheckpointError` at the first problem."""
    shapes = _policy(checkpoint)
    trainer_state = checkpoint.trainer_state()
    _trainer_state_fits(checkpoint, trainer_state, shapes)
    rollout_state = checkpoint.rollout_state()
    from stalebound.runtime.checkpoint import check_state

    try:
        check_state(rollout_state, rollout, checkpoint.version)
    except StaleboundError as exc:
        raise checkpoint.unusable(ROLLOUT_STATE, f"not an executor state ({exc})") from None
    return VerifiedCheckpoint(checkpoint, trainer_state, rollout_state, checkpoint.job_state())


def _policy(checkpoint: Checkpoint) -> list[tuple[int, ...]]:
    """Check the policy's files; return the shapes of the model's trainable parameters, in the
    order an optimizer over ``model.parameters()`` numbers them."""
    import torch
    from safetensors import SafetensorError, safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from stalebound.engines.models import load_tokenizer

    try:
        config = AutoConfig.from_pretrained(checkpoint.path, local_files_only=True)
        with torch.device("meta"):  # the model's shape, without its weights
            model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise checkpoint.unusable(
            "config.json", f"does not describe a model ({error_text(exc)})"
        ) from None
    try:
        load_tokenizer(checkpoint.path)
    except ConfigError as exc:
        why = str(exc).split("; ")[0]  # without the advice for a model path
        raise checkpoint.unusable("", f"its tokenizer does not load ({why})") from None
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied: dict[int, list[str]] = {}  # tensors held under several names are saved under one
    for name, t in model.state_dict().items():
        tied.setdefault(id(t), []).append(name)
    files = sorted(checkpoint.path.glob("*.safetensors"))
    if not files:
        raise checkpoint.unusable("model.safetensors", "missing: the checkpoint holds no weights")
    saved: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as weights:
                for key in weights.keys():  # noqa: SIM118 (not iterable itself)
                    saved[key] = tuple(weights.get_slice(key).get_shape())
        except (SafetensorError, OSError, ValueError) as exc:
            raise checkpoint.unusable(
                file.name, f"not a safetensors file this stalebound reads ({error_text(exc)})"
            ) from None
    where = files[0].name if len(files) == 1 else "the *.safetensors files"
    unknown = sorted(set(saved) - set(expected))
    wrong = [
        f"{k} {saved[k]} (the model's is {expected[k]})"
        for k in sorted(saved)
        if k in expected and saved[k] != expected[k]
    ]
    missing = [names[0] for names in tied.values() if not any(n in saved for n in names)]
    problems = (
        [f"tensors the model does not have: {_few(unknown)}"] * bool(unknown)
        + [f"tensors of another shape: {_few(wrong)}"] * bool(wrong)
        + [f"the model's tensors missing: {_few(missing)}"] * bool(missing)
    )
    if problems:
        raise checkpoint.unusable(
            where, f"does not hold the weights of the model in config.json ({'; '.join(problems)})"
        )
    from stalebound.train.lora import has_adapter

    if has_adapter(checkpoint.path):
        return _adapter_shapes(checkpoint, model)
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def _adapter_shapes(checkpoint: Checkpoint, model: Any) -> list[tuple[int, ...]]:
    """The shapes of the adapters of ``checkpoint/adapter`` on ``model`` (a meta model), in the
    order an optimizer over the adapted model's trainable parameters numbers them."""
    from stalebound.train.lora import ADAPTER_DIR, import_peft

    where = checkpoint.path / ADAPTER_DIR
    try:
        peft = import_peft()
        settings = peft.LoraConfig.from_pretrained(str(where))
        settings.inference_mode = False  # saved adapters say True: nothing would be trainable
        adapted = peft.get_peft_model(model, settings)
    except ConfigError as exc:
        raise checkpoint.unusable(f"{ADAPTER_DIR}/", f"cannot be read here ({exc})") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise checkpoint.unusable(
            f"{ADAPTER_DIR}/adapter_config.json",
            f"does not describe an adapter of this model ({error_text(exc)})",
        ) from None
    return [tuple(p.shape) for p in adapted.parameters() if p.requires_grad]


def _trainer_state_fits(
    checkpoint: Checkpoint, state: Mapping[str, Any], shapes: Sequence[tuple[int, ...]]
) -> None:
    """The optimizer state belongs to parameters of ``shapes``; the RNG states can be set."""
    import torch

    problem = _optimizer_problem(state["optimizer"], shapes)
    rng = state["rng"]
    if problem is None and rng["torch"].numel() != torch.get_rng_state().numel():
        problem = f"its torch RNG state has {rng['torch'].numel()} bytes, not {torch.get_rng_state().numel()}"
    if problem is None:
        try:
            random.Random().setstate(rng["python"])
        except (TypeError, ValueError, OverflowError) as exc:
            problem = f"its Python RNG state is not one ({error_text(exc)})"
    if problem is not None:
        raise checkpoint.unusable(TRAINER_STATE, f"does not fit the checkpoint's model: {problem}")


def _optimizer_problem(optimizer: Any, shapes: Sequence[tuple[int, ...]]) -> str | None:
    import torch

    if optimizer is None:
        return None
    groups, per_param = optimizer.get("param_groups"), optimizer.get("state")
    if not (isinstance(groups, list) and all(isinstance(g, dict) for g in groups)):
        return "the optimizer state has no list of parameter groups"
    numbers = [n for g in groups for n in (g.get("params") or [])]
    if numbers != list(range(len(shapes))):
        return (
            f"the optimizer holds {len(numbers)} parameters where the model has {len(shapes)} "
            "(or numbers them otherwise)"
        )
    if not isinstance(per_param, dict) or not set(per_param) <= set(numbers):
        return "the optimizer's per-parameter state is not keyed by its parameters"
    for number, values in per_param.items():
        if not isinstance(values, dict):
            return f"the optimizer's state of parameter {number} is not a mapping"
        for key, value in values.items():
            if (
                isinstance(value, torch.Tensor)
                and value.dim()
                and tuple(value.shape) != shapes[number]
            ):
                return (
                    f"the optimizer's {key} of parameter {number} has shape {tuple(value.shape)}, "
                    f"the parameter {shapes[number]}"
                )
    return None


def _few(names: Sequence[str]) -> str:
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


IGNORED_ON_RESUME = {
    "engine.model_path": "its policy comes from the checkpoint",
    "train.warm_start_steps": "it does not warm-start again",
    "train.warm_start_batch_size": "it does not warm-start again",
    "train.warm_start_lr": "it does not warm-start again",
}
"""Settings a resumed run has no use for, and why."""


def ignored_on_resume(cfg: Any, saved: Any) -> list[str]:
    """``name=value: why, and the fix`` for each setting of ``cfg`` that a resumed run would
    ignore and that differs from the run's own (``saved``, its ``config.yaml``)."""
    problems = []
    for key, why in IGNORED_ON_RESUME.items():
        now, then = attrgetter(key)(cfg), attrgetter(key)(saved)
        if now != then:
            problems.append(
                f"{key}={now!r}: a resumed run ignores it ({why}); drop it (the run's own is "
                f"{then!r}), or start a new run with it"
            )
    return problems


def run_dir_problem(run_dir: str | None, resumed: Path) -> str | None:
    """Why ``run.run_dir`` may not be given with a resume of the run in ``resumed`` (or
    ``None``): a resumed run continues in its own directory."""
    if not run_dir or Path(run_dir).resolve() == resumed.resolve():
        return None
    return (
        f"run.run_dir={run_dir!r}: a resumed run continues in its own directory ({resumed}), so "
        "it would be ignored; drop run.run_dir, or copy the run there and resume the copy"
    )
