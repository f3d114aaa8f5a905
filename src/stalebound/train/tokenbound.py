"""The token-level bound of the deadline action ``continue``: mask the tokens staler than η_h.

A group continued past its deadline is trained at a version ``c`` later than ``V_traj + η_h``.
Its tokens carry the version that generated them (the engine swaps weights between tokens), so
the ones generated before ``c − η_h`` are taken out of the loss (``loss_mask`` 0) and no *trained*
token is staler than the bound. Tokens already masked (tool replies) stay masked and are not
counted; trajectories of groups that were not continued have no such token and are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

from stalebound.tasks.episode import Trajectory

__all__ = ["mask_stale_tokens", "token_bound"]


def token_bound(staleness_policy: str, action: str, staleness: int) -> int | None:
    """The bound the trainer masks tokens at: η_h under the deadline action ``continue``, else
    ``None`` (every other setting bounds whole trajectories, or, under ``capacity``, none)."""
    return staleness if staleness_policy == "deadline" and action == "continue" else None


def mask_stale_tokens(trajectories: Iterable[Trajectory], batch_version: int, bound: int) -> int:
    """Set ``loss_mask`` 0 on every token generated before ``batch_version − bound``; return how
    many trained tokens that took out of the loss."""
    oldest = batch_version - bound
    masked = 0
    for t in trajectories:
        if not t.versions or min(t.versions) >= oldest:
            continue
        mask = [1] * len(t.output_ids) if t.loss_mask is None else list(t.loss_mask)
        for i, version in enumerate(t.versions):
            if version < oldest and mask[i]:
                mask[i] = 0
                masked += 1
        t.loss_mask = mask
    return masked
