"""A user's dataset: local files read through Hugging Face ``datasets``, streamed, shuffled with
the run's seed, resumable; each record a :class:`Row` with its prompt, answer and other columns."""

from stalebound.data.config import DataConfig
from stalebound.data.rows import Message, Row, RowError, make_row
from stalebound.data.source import DataPosition, RowStream, data_files, held_out

__all__ = [
    "DataConfig",
    "DataPosition",
    "Message",
    "Row",
    "RowError",
    "RowStream",
    "data_files",
    "held_out",
    "make_row",
]
