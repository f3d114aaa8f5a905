"""Checkpoints of a training run: written atomically, verified before anything is read back.

A run keeps its checkpoints in ``RUN_DIR/checkpoints``::

    checkpoints/
      latest                 the name of the newest complete checkpoint (replaced atomically)
      step-000040/
        manifest.json        format, step, version, and the size and SHA-256 of every other file
        config.json, model.safetensors, tokenizer files    the policy (Hugging Face layout)
        trainer_state.pt     optimizer state, version, RNG states (tensors and plain values only:
                             read with torch.load(weights_only=True))
        rollout_state.json   the executor's state_dict() as JSON data: buffers with their
                             trajectories, the items of running and queued groups, the data
                             loader's position (see stalebound.train.statejson)
        job_state.json       the job's running totals (rewards, counts, wall time) and the
                             settings a resumed run must share

A checkpoint is built in a hidden temporary directory; each file is flushed and fsynced, the
manifest is written last, the directory is renamed into place, and ``latest`` is replaced through
a temporary file and a rename. A crash at any point leaves the previous checkpoint and ``latest``
intact. :func:`open_checkpoint` checks the format and every file's size and checksum first, so a
damaged or foreign checkpoint is refused with the reason and the checkpoints that remain. Reading
a checkpoint runs no code from it: nothing in it is unpickled.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalebound.core import ConfigError, StaleboundError
from stalebound.obs.trace import run_traces
from stalebound.train import statejson

__all__ = [
    "CHECKPOINT_FORMAT",
    "Checkpoint",
    "CheckpointError",
    "CheckpointWriteError",
    "abandon_after",
    "checkpoint_dirs",
    "error_text",
    "find_checkpoint",
    "open_checkpoint",
    "read_json",
    "resume_target",
    "run_config_of",
    "run_dir_of",
    "write_checkpoint",
]

CHECKPOINT_FORMAT = 2
"""1: the executor state pickled (no longer read: unpickling runs code); 2: JSON data."""
CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
ROLLOUT_STATE = "rollout_state.json"
JOB_STATE = "job_state.json"
ABANDONED = "abandoned"
_PREFIX = "step-"
_NAME = re.compile(r"step-\d{6,}")


class CheckpointError(StaleboundError, RuntimeError):
    """A checkpoint cannot be written, found, or trusted; the message names the file and what to
    do instead."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (a full disk, say); the earlier checkpoints are intact."""


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint directory (from :func:`open_checkpoint`).

    Its files are read as data only: the trainer state with ``torch.load(weights_only=True)``,
    the executor and job states as JSON (:mod:`stalebound.train.statejson`). A file that does
    not parse as what it should hold raises :class:`CheckpointError` naming it and the earlier
    checkpoint to resume from instead."""

    path: Path
    step: int
    version: int
    manifest: Mapping[str, Any]

    def unusable(self, name: str, why: str) -> CheckpointError:
        """The error for a file of this checkpoint that cannot be used: it names the file, why,
        and the earlier checkpoint to resume from instead."""
        return CheckpointError(f"{self.path / name}: {why}{_instead(self.path)}")

    def trainer_state(self) -> dict[str, Any]:
        """``{"optimizer": state dict | None, "version": int, "rng": {"torch", "python"}}``."""
        import pickle

        import torch

        try:
            state = torch.load(self.path / TRAINER_STATE, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as exc:
            if "unsupported global" in str(exc).lower():  # a class or a function: code
                raise self.unusable(
                    TRAINER_STATE,
                    "holds objects other than tensors and plain values, which could run code "
                    "when read, so it is refused",
                ) from None
            raise self.unusable(
                TRAINER_STATE, "not a trainer state this stalebound reads (not a torch file)"
            ) from None
        except Exception as exc:  # junk makes the loader fail anyhow (struct.error, ...)
            raise self.unusable(
                TRAINER_STATE, f"not a trainer state this stalebound reads ({error_text(exc)})"
            ) from None
        rng = state.get("rng") if isinstance(state, dict) else None
        if not (
            isinstance(state, dict)
            and isinstance(state.get("optimizer"), dict | None)
            and type(state.get("version")) is int
            and isinstance(rng, dict)
            and isinstance(rng.get("torch"), torch.Tensor)
            and rng["torch"].dtype == torch.uint8
            and isinstance(rng.get("python"), tuple)
        ):
            raise self.unusable(
                TRAINER_STATE,
                "not a trainer state (it needs the optimizer state, the version and the torch "
                "and Python RNG states)",
            )
        return state

    def rollout_state(self) -> dict[str, Any]:
        """The executor's ``state_dict()`` (:meth:`WorkflowExecutor.load_state_dict` reads it)."""
        data = self._json(ROLLOUT_STATE)
        try:
            state = statejson.decode(data, "rollout state")
        except statejson.StateDataError as exc:
            raise self.unusable(ROLLOUT_STATE, f"not an executor state: {exc}") from None
        if not isinstance(state, dict):
            raise self.unusable(ROLLOUT_STATE, "not an executor state (not a JSON object)")
        return state

    def job_state(self) -> dict[str, Any]:
        """The job's running totals and settings (their fields are checked by the job)."""
        state = self._json(JOB_STATE)
        if not isinstance(state, dict):
            raise self.unusable(JOB_STATE, "not a job state (not a JSON object)")
        return state

    def _json(self, name: str) -> Any:
        try:
            return read_json(self.path / name)
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise self.unusable(name, f"not valid JSON ({exc})") from None


MAX_JSON_DEPTH = 100
"""The deepest nesting of lists and objects a checkpoint's JSON file may hold (an executor's state
nests about 15 deep); deeper data is refused before it is parsed, so that neither the parser nor
the decoder recurses without bound."""
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """The deepest nesting of lists and objects in the JSON ``text`` (brackets inside strings
    do not count)."""
    brackets = _NOT_A_BRACKET.sub("", _JSON_STRING.sub("", text))
    depth = deepest = 0
    for bracket in brackets:
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def read_json(path: Path) -> Any:
    """The JSON value in ``path``; ``ValueError`` when it is not JSON or nests deeper than
    :data:`MAX_JSON_DEPTH`."""
    text = path.read_text(encoding="utf-8")
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(
            f"it nests {depth} deep, more than the {MAX_JSON_DEPTH} a checkpoint holds"
        )
    return json.loads(text)


def error_text(exc: BaseException) -> str:
    """``Type: message`` of a library's error, on one line and at most 200 characters."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


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


def _step_of(path: Path) -> int | None:
    return int(path.name[len(_PREFIX) :]) if _NAME.fullmatch(path.name) else None


def checkpoint_dirs(root: Path) -> list[Path]:
    """The checkpoint directories under ``root`` (``RUN_DIR/checkpoints``), oldest first. Only
    complete ones have such a name: a checkpoint is renamed into place once it is whole."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _step_of(p) is not None and p.is_dir()]
    return sorted(found, key=lambda p: _step_of(p) or 0)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive meanwhile are handled once the block is done: a second
    Ctrl-C cannot stop a checkpoint half put in place. (Python runs signal handlers in the main
    thread only, so only there is anything to defer.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in caught:
            handler = previous[signal.Signals(signum)]
            if callable(handler):
                handler(signum, None)
            elif handler != signal.SIG_IGN:
                signal.raise_signal(signum)


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
    tokenizer) into the directory. ``trainer_state`` holds tensors and plain values;
    ``rollout_state`` the executor's data (see :mod:`stalebound.train.statejson`). Raises
    :class:`CheckpointError` when a state is not data or the disk refuses, leaving the earlier
    checkpoints as they were."""
    import torch

    from stalebound import __version__

    root = run_dir / CHECKPOINTS
    name = f"{_PREFIX}{step:06d}"
    final = root / name
    tmp = root / f".{name}.tmp"
    try:
        rollout_json = json.dumps(statejson.encode(dict(rollout_state), "rollout state"))
    except statejson.StateDataError as exc:
        raise CheckpointError(f"checkpoint of step {step}: {exc}") from None
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_model(tmp)
        _write_file(tmp / TRAINER_STATE, lambda f: torch.save(dict(trainer_state), f))
        _write_file(tmp / ROLLOUT_STATE, lambda f: f.write(rollout_json), "w")
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
        with _signals_deferred():
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
            why = f"{exc.strerror or exc} ({exc.filename or final}"
        else:
            why = f"{type(exc).__name__}: {exc} ({final}"
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(run_dir).free
            why += f"; {free} bytes free on that disk"
            need = _checkpoint_bytes(root / kept[-1]) if kept else 0
            if free < need and getattr(exc, "errno", None) != errno.ENOSPC:
                # the library's own error hides the cause: a checkpoint no longer fits
                why = f"No space left on device: {why}, a checkpoint takes {need}"
        raise CheckpointWriteError(
            f"writing the checkpoint of step {step} failed: {why})"
            + (f"; the earlier checkpoints {kept} are intact" if kept else "")
        ) from exc
    for old_dir in checkpoint_dirs(root)[:-keep]:
        if old_dir != final:
            shutil.rmtree(old_dir, ignore_errors=True)
    return final


def _checkpoint_bytes(where: Path) -> int:
    """The bytes a written checkpoint holds, from its manifest (0 if it does not read)."""
    try:
        files = json.loads((where / MANIFEST).read_text())["files"]
        return sum(int(f["bytes"]) for f in files.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def run_dir_of(path: str | Path) -> Path:
    """The run directory of ``path``: the path itself, or the run a checkpoint directory is in."""
    p = Path(path)
    if (p / MANIFEST).exists() or p.name.startswith(_PREFIX):
        return p.parent.parent
    if p.name == CHECKPOINTS:
        return p.parent
    return p


def run_config_of(resume: str) -> Path:
    """The ``config.yaml`` of the run ``resume=`` names (a run directory or one of its
    checkpoints); one ConfigError when there is none to read."""
    from stalebound.userfiles import label, readable_problem

    fix = "give the directory of a run written by stalebound train, or one of its checkpoints"
    problem = readable_problem(resume, label("resume", resume), fix=fix)
    if problem:
        raise ConfigError(problem)
    saved = run_dir_of(resume) / "config.yaml"
    if not saved.is_file():
        raise ConfigError(
            f"resume={resume!r}: neither a checkpoint nor the directory of a run ({saved} does "
            f"not exist); {fix}"
        )
    return saved


def _problem(where: Path) -> tuple[str, dict[str, Any] | None]:
    """What is wrong with checkpoint directory ``where`` ('' when nothing), and its manifest."""
    manifest_path = where / MANIFEST
    try:
        manifest = read_json(manifest_path)
    except FileNotFoundError:
        return f"{where}: not a complete checkpoint (no {MANIFEST})", None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return f"{manifest_path}: unreadable or corrupt ({exc})", None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return f"{manifest_path}: not a stalebound checkpoint manifest", None
    fmt = manifest.get("format")
    if fmt != CHECKPOINT_FORMAT:
        return (
            f"{where}: checkpoint format {fmt!r} (written by stalebound "
            f"{manifest.get('stalebound')!r}); this stalebound reads format {CHECKPOINT_FORMAT}",
            None,
        )
    for rel, meta in manifest["files"].items():
        file = where / str(rel)
        problem = None
        if not isinstance(meta, dict):
            problem = "the manifest's entry for it is not an object"
        else:
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
            return f"{file}: corrupt checkpoint file: {problem}", None
    stranger = _unlisted(where, manifest["files"])
    if stranger:
        return stranger, None
    step, version = manifest.get("step"), manifest.get("version")
    if type(step) is not int or type(version) is not int or step < 0 or version < 0:
        return f"{manifest_path}: no valid step or version in the manifest", None
    return "", manifest


_FOREIGN_WEIGHTS = frozenset(
    {".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".h5", ".msgpack", ".npy", ".npz", ".gguf"}
)
"""Weight and pickle formats a checkpoint of this project never holds (its weights are
safetensors, its trainer state the one ``trainer_state.pt``)."""


def _unlisted(where: Path, listed: Mapping[str, Any]) -> str:
    """What in checkpoint directory ``where`` is not one of its ``listed`` files ('' when
    nothing): a weight file of another format than safetensors, a link, or a file the manifest
    does not list. Such a file would be read unverified (a library loading the directory picks
    up what it finds there), so it is refused by name."""
    for path in sorted(where.rglob("*")):
        rel = path.relative_to(where).as_posix()
        if rel == MANIFEST or (path.is_dir() and not path.is_symlink()):
            continue
        if path.suffix.lower() in _FOREIGN_WEIGHTS and rel != TRAINER_STATE:
            return (
                f"{path}: a {path.suffix} file in a checkpoint, which this stalebound never "
                "writes: its weights are safetensors only (other formats can run code when "
                "read), so the checkpoint is refused"
            )
        if path.is_symlink() or not path.is_file():
            return f"{path}: not a regular file; a checkpoint holds files only"
        if rel not in listed:
            return (
                f"{path}: not listed in {MANIFEST}, so it is not verified; a checkpoint holds "
                "only the files its manifest lists"
            )
    return ""


def _intact(root: Path, below: int | None = None, skip: Path | None = None) -> Path | None:
    """The newest checkpoint under ``root`` (older than step ``below``) that verifies."""
    for path in reversed(checkpoint_dirs(root)):
        step = _step_of(path)
        if path == skip or (below is not None and step is not None and step >= below):
            continue
        if not _problem(path)[0]:
            return path
    return None


def _no_checkpoint(run_dir: Path) -> str:
    return (
        f"{run_dir}: no checkpoint yet (the run stopped before its first one); "
        f"`stalebound train resume={run_dir}` starts it again from the beginning"
    )


def find_checkpoint(path: str | Path) -> Checkpoint | None:
    """The checkpoint ``resume=path`` continues from, verified: ``path`` itself when it is a
    checkpoint directory; for a run directory the one ``latest`` names (or, when ``latest`` was
    not written yet, the newest complete one). ``None`` for a run directory with no checkpoint at
    all (it stopped before its first: it can only start again). Raises :class:`CheckpointError`
    for a damaged or missing checkpoint, naming an intact one to use instead."""
    p = Path(path)
    if (p / MANIFEST).exists() or p.name.startswith(_PREFIX):
        return _open(p)
    root = p if p.name == CHECKPOINTS else p / CHECKPOINTS
    latest = root / LATEST
    if not latest.is_file():
        found = checkpoint_dirs(root)
        return _open(found[-1]) if found else None
    try:
        name = latest.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        name, why = "", f"cannot be read ({exc})"
    else:
        why = "" if _NAME.fullmatch(name) else f"holds {name[:60]!r}, not a checkpoint name"
    if not why and not (root / name).is_dir():
        why = f"names {name}, which does not exist"
    if why:
        intact = _intact(root)
        raise CheckpointError(
            f"{latest}: {why}; the file is damaged — "
            + (
                f"resume from the newest intact checkpoint: resume={intact}"
                if intact is not None
                else f"no intact checkpoint is left in {root}; start a new run"
            )
        )
    return _open(root / name)


def resume_target(run_dir: Path) -> Path | None:
    """The checkpoint ``resume=run_dir`` would continue from, as the disk says now (``latest``,
    or the newest complete one), unverified; ``None`` when there is none. Messages name it."""
    root = run_dir / CHECKPOINTS
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if _NAME.fullmatch(name) and (root / name).is_dir():
        return root / name
    found = checkpoint_dirs(root)
    return found[-1] if found else None


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Find (a run directory means its ``latest``, see :func:`find_checkpoint`) and verify a
    checkpoint: its manifest's format and every file's size and SHA-256. Raises
    :class:`CheckpointError` naming what is wrong."""
    found = find_checkpoint(path)
    if found is None:
        raise CheckpointError(_no_checkpoint(run_dir_of(path)))
    return found


def _instead(where: Path) -> str:
    """What to resume from when checkpoint ``where`` cannot be used: an earlier intact one, or
    else a later one (when ``where`` was not the newest)."""
    earlier = _intact(where.parent, below=_step_of(where), skip=where)
    if earlier is not None:
        return f"; resume from an earlier checkpoint instead, e.g. resume={earlier}"
    later = _intact(where.parent, skip=where)
    if later is not None:
        return f"; resume from another checkpoint instead: resume={later}"
    return "; no other intact checkpoint of this run is left, so start a new run"


def _open(where: Path) -> Checkpoint:
    problem, manifest = _problem(where)
    if manifest is None:
        if "checkpoint format" in problem:
            raise CheckpointError(f"{problem}. Resume it with the stalebound version that wrote it")
        raise CheckpointError(problem + _instead(where))
    return Checkpoint(where, manifest["step"], manifest["version"], manifest)


def abandon_after(run_dir: Path, checkpoint: Checkpoint) -> list[Path]:
    """Make ``checkpoint`` the run's newest: point ``latest`` at it, then move the run's newer
    checkpoints and the episode traces of resumes after it into ``RUN_DIR/abandoned/`` (their
    records are cut back when the resumed run opens them), so that the run has one history.
    Returns where the moved things now are. A crash in between leaves ``latest`` naming
    ``checkpoint``, and the next resume finishes the job."""
    root = run_dir / CHECKPOINTS
    if checkpoint.path.parent.resolve() != root.resolve():
        return []
    latest = root / LATEST
    current = latest.read_text(encoding="utf-8").strip() if latest.is_file() else None
    if current != checkpoint.path.name:
        atomic_write_text(latest, checkpoint.path.name + "\n")
    newer = [p for p in checkpoint_dirs(root) if (_step_of(p) or 0) > checkpoint.step]
    traces = [path for step, path in run_traces(run_dir) if step > checkpoint.step]
    if newer and (run_dir / "summary.json").exists():  # of the later, abandoned end
        traces.append(run_dir / "summary.json")
    moved = []
    for path in [*newer, *traces]:
        target = run_dir / ABANDONED / path.name
        n = 1
        while target.exists():
            n += 1
            target = run_dir / ABANDONED / f"{path.stem}-{n}{path.suffix}"
        target.parent.mkdir(exist_ok=True)
        os.replace(path, target)
        moved.append(target)
    if moved:
        _fsync_dir(run_dir)
    return moved
