"""The GPU tier (``make test-gpu``): every test here is marked ``gpu`` and skipped, with the reason
printed, on a machine without a CUDA GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the bench scripts the tier runs (bench/ is not a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


SKIP_REASON = "needs a CUDA GPU: none found (torch.cuda.is_available() is False)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    cuda = _cuda()
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if not cuda:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
