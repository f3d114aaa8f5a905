"""A user's dataset as an endless, resumable stream of rows.

Files are read through Hugging Face ``datasets`` in streaming mode (local files only; nothing is
downloaded), so a file of any size starts at once and only ``data.shuffle_buffer`` rows are held
in memory. The order is a pure function of the seed, the epoch and the data, which makes a
position — ``(epoch, records read in it)`` — enough to resume exactly where a run stopped: no row
is skipped or seen twice.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalebound.core.errors import ConfigError
from stalebound.data.config import DataConfig
from stalebound.data.rows import _INDEX, Row, RowError, make_row
from stalebound.userfiles import label

__all__ = ["DataPosition", "RowStream", "data_files", "held_out"]

log = logging.getLogger(__name__)

_READERS = {
    ".jsonl": "json",
    ".ndjson": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
_GLOB = set("*?[")
_SAVED_MARKERS = ("dataset_info.json", "state.json")  # what Dataset.save_to_disk writes
_FIX = "give local JSONL, JSON, Parquet or CSV files, a glob, or a save_to_disk directory"


@dataclass(frozen=True)
class DataFiles:
    """What a ``data.path`` setting resolved to: files of one reader, or a saved dataset."""

    reader: str  # "json", "parquet", "csv" or "saved"
    paths: tuple[str, ...]


def _reader(path: Path, head: str) -> str:
    suffixes = [s for s in path.suffixes if s not in _COMPRESSED]
    kind = _READERS.get(suffixes[-1].lower() if suffixes else "")
    if kind is None:
        raise ConfigError(
            f"{head}: {path.name!r} is not a data file stalebound reads (by its ending); {_FIX}"
        )
    return kind


def data_files(spec: str | list[str], setting: str = "data.path") -> DataFiles:
    """Resolve a path setting to its files (globs expanded, sorted); raises :class:`ConfigError`
    for a missing file, a glob that matches nothing, a directory that is not a saved dataset, or
    files of different kinds."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    if not specs:
        raise ConfigError(f"{setting}=[]: names no file; {_FIX}")
    files: list[Path] = []
    for s in specs:
        head = label(setting, s)
        if _GLOB & set(s):
            matched = sorted(glob.glob(os.path.expanduser(s), recursive=True))
            if not matched:
                raise ConfigError(f"{head}: the glob matches no file; check the pattern and {_FIX}")
            files.extend(Path(m) for m in matched if Path(m).is_file())
            continue
        p = Path(os.path.expanduser(s))
        if p.is_dir():
            if any((p / m).is_file() for m in _SAVED_MARKERS):
                if len(specs) > 1:
                    raise ConfigError(
                        f"{head}: a saved dataset directory cannot be mixed with other paths; "
                        f"name it alone"
                    )
                return DataFiles("saved", (str(p),))
            raise ConfigError(
                f"{head}: is a directory but not one written by Dataset.save_to_disk; name its "
                f"files or a glob such as {str(p / '*.jsonl')!r}"
            )
        if not p.is_file():
            raise ConfigError(f"{head}: no such file; {_FIX}")
        files.append(p)
    kinds = {f: _reader(f, label(setting, str(f))) for f in files}
    if len(set(kinds.values())) > 1:
        raise ConfigError(
            f"{label(setting, spec)}: mixes {sorted(set(kinds.values()))} files; read one kind "
            "at a time (convert the others)"
        )
    return DataFiles(next(iter(kinds.values())), tuple(str(f) for f in files))


def _open(files: DataFiles) -> Any:
    """The files as a ``datasets.IterableDataset`` with each record's position added."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never reach for the hub
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    # a file its reader refuses is logged there as well as raised: the ConfigError says it once
    for reader in ("parquet", "json", "csv"):
        logging.getLogger(f"datasets.packaged_modules.{reader}.{reader}").setLevel(logging.CRITICAL)
    if files.reader == "saved":
        ds = datasets.load_from_disk(files.paths[0])
        if isinstance(ds, datasets.DatasetDict):
            raise ConfigError(
                f"data.path={files.paths[0]!r}: holds the splits {list(ds)}, not one dataset; "
                f"name one split's directory, e.g. {str(Path(files.paths[0]) / next(iter(ds)))!r}"
            )
        stream = ds.to_iterable_dataset()
    else:
        stream = datasets.load_dataset(
            files.reader, data_files=list(files.paths), split="train", streaming=True
        )
    return stream.map(lambda _, i: {_INDEX: i}, with_indices=True)


def _mix(seed: int, index: int) -> float:
    """A uniform number in [0, 1) from the seed and a row's position (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) / 2.0**64


def held_out(seed: int, index: int, fraction: float) -> bool:
    """Whether the row at ``index`` is held out for evaluation (``data.eval_fraction``)."""
    return fraction > 0 and _mix(seed, index) < fraction


@dataclass(frozen=True)
class DataPosition:
    """Where a stream stands: the epoch and the records of it read so far (rows of the other
    split and skipped rows included)."""

    epoch: int = 0
    read: int = 0

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "read": self.read}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DataPosition:
        try:
            epoch, read = data["epoch"], data["read"]
        except (KeyError, TypeError):
            raise ConfigError(
                f"data position {data!r}: needs 'epoch' and 'read'; resume from a checkpoint "
                "written by stalebound train"
            ) from None
        if not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, read)
        ):
            raise ConfigError(f"data position {data!r}: epoch and read must be integers ≥ 0")
        return cls(epoch, read)


class RowStream:
    """The rows of ``cfg.path`` (``split="train"``) or the held-out rows (``split="eval"``), epoch
    after epoch, shuffled with ``seed`` when ``cfg.shuffle``.

    Iterating yields :class:`Row` objects; :attr:`position` says where the stream stands and
    :meth:`seek` continues from a saved position. A row that cannot be trained on (found after
    the rows :meth:`check` looks at) is skipped and counted in :attr:`skipped`.
    """

    def __init__(self, cfg: DataConfig, *, seed: int, split: str = "train") -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r}: use 'train' or 'eval'")
        spec = cfg.eval_path if split == "eval" and cfg.eval_path is not None else cfg.path
        if spec is None:
            raise ConfigError("data.path=None: no dataset is configured; set data.path")
        self.cfg = cfg
        self.seed = seed
        self.split = split
        self.setting = "data.eval_path" if spec is cfg.eval_path else "data.path"
        self.files = data_files(spec, self.setting)
        # the rows of this split are taken from a file shared with the other split
        self._fraction = cfg.eval_fraction if cfg.eval_path is None else 0.0
        self._position = DataPosition()
        self.skipped = 0
        self._stream: Any = None

    @property
    def position(self) -> DataPosition:
        return self._position

    def seek(self, position: DataPosition) -> None:
        """Continue from ``position`` (as :attr:`position` gave it)."""
        self._position = position

    def _ours(self, index: int) -> bool:
        if self._fraction == 0.0:
            return True
        return held_out(self.seed, index, self._fraction) == (self.split == "eval")

    def _records(self, *, shuffled: bool, epoch: int) -> Iterator[Mapping[str, Any]]:
        try:
            if self._stream is None:
                self._stream = _open(self.files)
            stream = self._stream
            if shuffled:
                stream = stream.shuffle(seed=self.seed, buffer_size=self.cfg.shuffle_buffer)
                stream.set_epoch(epoch)
            yield from stream
        except (ConfigError, GeneratorExit):
            raise
        except StopIteration:  # what the readers raise for a file with no record
            return
        except Exception as e:  # pyarrow, json and datasets errors share no base class
            raise ConfigError(
                f"{label(self.setting, self.files.paths[0])}: cannot read it as "
                f"{self.files.reader} ({_one_line(e)}); {_FIX}"
            ) from None

    def _row(self, record: Mapping[str, Any]) -> Row:
        index = int(record[_INDEX])
        return make_row(record, self.cfg, source=self.setting, index=index)

    def check(self) -> None:
        """Read the first ``data.check_rows`` records and raise :class:`ConfigError` for the first
        that cannot be trained on, or if the split holds no row at all."""
        ours = 0
        for n, record in enumerate(self._records(shuffled=False, epoch=0)):
            if n >= self.cfg.check_rows:
                break
            try:
                self._row(record)
            except RowError as e:
                raise ConfigError(str(e)) from None
            ours += self._ours(int(record[_INDEX]))
        if ours == 0:
            what = "no rows" if self._fraction == 0.0 else f"no {self.split} rows in the first rows"
            raise ConfigError(
                f"{label(self.setting, _spec_text(self.files))}: holds {what}; give a file with "
                "at least one record"
                + ("" if self._fraction == 0.0 else " or change data.eval_fraction")
            )

    def head(self, n: int) -> list[Row]:
        """The first ``n`` rows of this split in the data's own order (for evaluation)."""
        out: list[Row] = []
        for row in self._rows(self._records(shuffled=False, epoch=0), count=False):
            out.append(row)
            if len(out) >= n:
                break
        return out

    def _rows(self, records: Iterable[Mapping[str, Any]], *, count: bool) -> Iterator[Row]:
        for record in records:
            if count:
                self._position = DataPosition(self._position.epoch, self._position.read + 1)
            if not self._ours(int(record[_INDEX])):
                continue
            try:
                row = self._row(record)
            except RowError as e:
                self.skipped += 1
                log.warning(
                    "skipped a row that cannot be trained on (%d so far): %s", self.skipped, e
                )
                continue
            yield row

    def __iter__(self) -> Iterator[Row]:
        epochs = self.cfg.epochs
        while epochs is None or self._position.epoch < epochs:
            epoch, skip = self._position.epoch, self._position.read
            records = self._records(shuffled=self.cfg.shuffle, epoch=epoch)
            for _ in range(skip):  # resume: the same order again, up to where it stopped
                if next(records, None) is None:
                    break
            yielded = False
            for row in self._rows(records, count=True):
                yielded = True
                yield row
            if not yielded and skip == 0:
                raise ConfigError(
                    f"{label(self.setting, _spec_text(self.files))}: epoch {epoch} gave no row "
                    f"that can be trained on ({self.skipped} skipped); fix the data"
                )
            self._position = DataPosition(epoch + 1, 0)


def _spec_text(files: DataFiles) -> str:
    return files.paths[0] if len(files.paths) == 1 else f"{len(files.paths)} files"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."
