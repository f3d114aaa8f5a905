"""The token-level bound of the deadline action ``continue``: tokens generated before
``batch version − η_h`` leave the loss; nothing else changes."""

from __future__ import annotations

from stalebound.tasks.episode import Trajectory
from stalebound.train.tokenbound import mask_stale_tokens, token_bound


def traj(versions: list[int], loss_mask: list[int] | None = None) -> Trajectory:
    n = len(versions)
    return Trajectory([1], list(range(n)), [0.0] * n, versions, 1.0, loss_mask=loss_mask)


def test_tokens_staler_than_the_bound_are_masked_and_counted() -> None:
    continued = traj([0, 0, 1, 2, 3])  # V = 0, trained at version 4 with η_h = 2
    tool = traj([1, 1, 2, 3], loss_mask=[1, 0, 1, 1])  # a tool token stays masked, not counted
    fresh = traj([2, 3])
    assert mask_stale_tokens([continued, tool, fresh], batch_version=4, bound=2) == 4
    assert continued.loss_mask == [0, 0, 0, 1, 1]
    assert tool.loss_mask == [0, 0, 1, 1]
    assert fresh.loss_mask is None  # untouched


def test_only_the_deadline_action_continue_bounds_tokens() -> None:
    assert token_bound("deadline", "continue", 2) == 2
    assert token_bound("deadline", "truncate", 2) is None
    assert token_bound("capacity", "continue", 2) is None  # capacity bounds nothing per token
