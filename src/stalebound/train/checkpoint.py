"""Checkpoints of a training run: written atomically, verified before anything is read back.

A run keeps its checkpoints in ``RUN_DIR/checkpoints``::

    checkpoints/
      latest                 the name of the newest complete checkpoint (replaced atomically)
      step-000040/
        manifest.json        format, step, version, and the size and SHA-256 of every other file
        config.json, model.safetensors, tokenizer files    the policy (Hugging Face layout)
        trainer_state.pt     optimizer state, version, RNG states (torch.save)
        rollout_state.pkl    the executor's state_dict(): buffers with their trajectories, the
                             items of running and queued groups, the data loader's position
        job_state.json       the job's running totals (rewards, counts, wall time) and the
                             settings a resumed run must share

A checkpoint is built in a hidden temporary directory; each file is flushed and fsynced, the
manifest is written last, the directory is renamed into place, and ``latest`` is replaced through
a temporary file and a rename. A crash at any point leaves the previous checkpoint and ``latest``
intact. :func:`open_checkpoint` checks the format and every file's size and checksum first, so a
damaged or foreign checkpoint is refused with the reason and the checkpoints that remain.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalebound.core import StaleboundError

__all__ = [
    "CHECKPOINT_FORMAT",
    "Checkpoint",
    "CheckpointError",
    "checkpoint_dirs",
    "open_checkpoint",
    "run_dir_of",
    "write_checkpoint",
]

CHECKPOINT_FORMAT = 1
CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
ROLLOUT_STATE = "rollout_state.pkl"
JOB_STATE = "job_state.json"
_PREFIX = "step-"


class CheckpointError(StaleboundError, RuntimeError):
    """A checkpoint cannot be written, found, or trusted; the message names the file and what to
    do instead."""


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint directory (from :func:`open_checkpoint`)."""

    path: Path
    step: int
    version: int
    manifest: Mapping[str, Any]

    def trainer_state(self) -> dict[str, Any]:
        import torch

        state: dict[str, Any] = torch.load(self.path / TRAINER_STATE, weights_only=False)
        return state

    def rollout_state(self) -> dict[str, Any]:
        with open(self.path / ROLLOUT_STATE, "rb") as f:
            state: dict[str, Any] = pickle.load(f)
        return state

    def job_state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((self.path / JOB_STATE).read_text())
        return state


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_file(path: Path, write: Callable[[Any], None], mode: str = "wb") -> None:
    with open(path, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` through a temporary file, fsync and rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    _write_file(tmp, lambda f: f.write(text), "w")
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def checkpoint_dirs(root: Path) -> list[Path]:
    """The complete checkpoint directories under ``root`` (``RUN_DIR/checkpoints``), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(_PREFIX) and p.is_dir()]
    return sorted(found, key=lambda p: p.name)


def write_checkpoint(
    run_dir: Path,
    step: int,
    version: int,
    *,
    save_model: Callable[[Path], None],
    trainer_state: Mapping[str, Any],
    rollout_state: Mapping[str, Any],
    job_state: Mapping[str, Any],
    keep: int = 2,
) -> Path:
    """Write ``RUN_DIR/checkpoints/step-NNNNNN`` atomically, point ``latest`` at it and delete all
    but the newest ``keep``; return its path. ``save_model(directory)`` writes the policy (and its
    tokenizer) into the directory. Raises :class:`CheckpointError` when the disk refuses, leaving
    the earlier checkpoints as they were."""
    import torch

    from stalebound import __version__

    root = run_dir / CHECKPOINTS
    name = f"{_PREFIX}{step:06d}"
    final = root / name
    tmp = root / f".{name}.tmp"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_model(tmp)
        _write_file(tmp / TRAINER_STATE, lambda f: torch.save(dict(trainer_state), f))
        _write_file(
            tmp / ROLLOUT_STATE,
            lambda f: pickle.dump(dict(rollout_state), f, protocol=pickle.HIGHEST_PROTOCOL),
        )
        _write_file(tmp / JOB_STATE, lambda f: f.write(json.dumps(job_state, indent=1)), "w")
        files: dict[str, dict[str, Any]] = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            with open(path, "rb+") as f:  # the model files were written by another library
                os.fsync(f.fileno())
            rel = path.relative_to(tmp).as_posix()
            files[rel] = {"bytes": path.stat().st_size, "sha256": _digest(path)}
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "stalebound": __version__,
            "step": step,
            "version": version,
            "created": time.time(),
            "files": files,
        }
        _write_file(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1)), "w")
        _fsync_dir(tmp)
        if final.exists():  # the same step written before a crash: swap, then delete the old
            old = root / f".{name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        atomic_write_text(root / LATEST, name + "\n")
    except Exception as exc:  # torch and safetensors report a full disk as their own errors
        shutil.rmtree(tmp, ignore_errors=True)
        kept = [p.name for p in checkpoint_dirs(root)]
        if isinstance(exc, OSError):
            why = f"{exc.strerror or exc} ({exc.filename or final})"
        else:
            why = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):
            why += f"; {shutil.disk_usage(run_dir).free} bytes free on that disk"
        raise CheckpointError(
            f"writing checkpoint {final} failed: {why}; "
            + (f"the earlier checkpoints {kept} are intact. " if kept else "")
            + "Free space on that disk or point run.run_dir at a writable directory"
        ) from exc
    for old_dir in checkpoint_dirs(root)[:-keep]:
        if old_dir != final:
            shutil.rmtree(old_dir, ignore_errors=True)
    return final


def run_dir_of(path: str | Path) -> Path:
    """The run directory of ``path``: the path itself, or the run a checkpoint directory is in."""
    p = Path(path)
    if (p / MANIFEST).exists() or p.name.startswith(_PREFIX):
        return p.parent.parent
    if p.name == CHECKPOINTS:
        return p.parent
    return p


def _locate(path: Path) -> Path:
    if (path / MANIFEST).exists() or path.name.startswith(_PREFIX):
        return path
    root = path if path.name == CHECKPOINTS else path / CHECKPOINTS
    latest = root / LATEST
    if not latest.is_file():
        found = [p.name for p in checkpoint_dirs(root)]
        raise CheckpointError(
            f"resume={str(path)!r}: no checkpoint to resume from ({latest} does not exist"
            + (f"; found {found}, give one of them as resume=..." if found else "")
            + "); pass a run directory that was written with run.checkpoint=true, or a "
            "checkpoint directory"
        )
    name = latest.read_text().strip()
    if not name.startswith(_PREFIX) or "/" in name:
        raise CheckpointError(
            f"{latest}: holds {name!r}, not a checkpoint name; the file is damaged — give a "
            f"checkpoint directory explicitly, e.g. resume={root}/step-000040"
        )
    return root / name


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Find (a run directory means its ``latest``) and verify a checkpoint: its manifest's format
    and every file's size and SHA-256. Raises :class:`CheckpointError` naming what is wrong."""
    where = _locate(Path(path))
    others = [p for p in checkpoint_dirs(where.parent) if p != where]
    hint = (
        f"; resume from an earlier checkpoint instead, e.g. resume={others[-1]}"
        if others
        else "; no other checkpoint of this run is left, so start a new run"
    )
    manifest_path = where / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{where}: not a complete checkpoint (no {MANIFEST}){hint}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable or corrupt ({exc}){hint}") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{manifest_path}: not a stalebound checkpoint manifest{hint}")
    fmt = manifest.get("format")
    if fmt != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{where}: checkpoint format {fmt!r} (written by stalebound "
            f"{manifest.get('stalebound')!r}); this stalebound reads format {CHECKPOINT_FORMAT}. "
            "Resume it with the stalebound version that wrote it"
        )
    for rel, meta in manifest["files"].items():
        file = where / rel
        problem = None
        try:
            size = file.stat().st_size
        except OSError as exc:
            problem = f"missing ({exc.strerror})"
        else:
            if size != meta.get("bytes"):
                problem = f"{size} bytes, the manifest says {meta.get('bytes')}"
            elif _digest(file) != meta.get("sha256"):
                problem = "its SHA-256 differs from the manifest's"
        if problem is not None:
            raise CheckpointError(f"{file}: corrupt checkpoint file: {problem}{hint}")
    with contextlib.suppress(KeyError, TypeError, ValueError):
        return Checkpoint(where, int(manifest["step"]), int(manifest["version"]), manifest)
    raise CheckpointError(f"{manifest_path}: no valid step or version in the manifest{hint}")
