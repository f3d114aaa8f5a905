from __future__ import annotations

import random

import pytest

from stalebound.engines.cohorts import COHORT_PADDING_SLOTS, MAX_COHORTS, next_merge, padding
from stalebound.sim.cohorts import Cohorts


def test_the_merge_rule_pads_the_narrower_rows_and_keeps_at_most_eight_cohorts() -> None:
    assert padding((4, 0), (64, 10)) == 40  # the 4 rows padded by 10 positions
    assert padding((64, 10), (4, 0)) == 40
    assert next_merge([(4, 0), (64, 10), (1, 110)], 1024) == 0
    assert next_merge([(68, 10), (1, 110)], 1024) is None  # 6800 slots: apart
    assert next_merge([(68, 10), (1, 110)], None) == 0  # no budget: one cohort
    nine = [(100, 2000 * k) for k in range(MAX_COHORTS + 1)]
    assert next_merge(nine, 1024) == 0  # too many: the cheapest pair merges anyway
    assert next_merge(nine[:MAX_COHORTS], 1024) is None


def test_cohorts_form_at_joins_merge_by_the_rule_and_narrow_as_rows_leave() -> None:
    c = Cohorts(COHORT_PADDING_SLOTS)
    straggler = c.join(0.0)
    assert c.count(0.0) == 1
    batch = [c.join(100.0) for _ in range(64)]  # one admission: one cohort
    assert len({id(x) for x in batch}) == 1
    assert c.count(100.0) == 2  # 64 rows × 100 positions of padding: two passes
    late = [c.join(110.0) for _ in range(4)]
    # widths 0 (4 rows), 10 (64 rows), 110 (1 row): the 4 pad 40 slots and merge
    assert c.count(110.0) == 2
    for x in batch[:60]:
        c.leave(x, 100.0)
    # 8 rows 10 wide beside the straggler 110 wide: 8 × 100 = 800 slots, within 1024
    assert c.count(120.0) == 1
    c.leave(straggler, 0.0)
    for x in late:
        c.leave(x, 110.0)
    newcomers = [c.join(350.0) for _ in range(4)]
    # the 4 rows left joined at 100 (the straggler's columns went with it): 250 wide, so the
    # newcomers pad 4 × 250 = 1000 slots and merge (4 × 350 = 1400 would keep them apart)
    assert c.count(350.0) == 1
    for x in batch[60:]:
        c.leave(x, 100.0)
    for x in newcomers:
        c.leave(x, 350.0)
    assert c.count(351.0) == 0


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_simulated_cohorts_match_the_embedded_workers_on_the_same_widths() -> None:
    # the worker's own consolidation on cohorts of the given rows and cache widths (empty
    # caches: only the masks' shapes matter to the rule) against the model's count
    torch = pytest.importorskip("torch")
    from stalebound.engines._worker import Worker, _Cohort

    rng = random.Random(3)
    for _ in range(200):
        widths = rng.sample(range(1, 600), rng.randint(1, 12))
        shapes = [(rng.randint(1, 64), width) for width in widths]
        worker = Worker.__new__(Worker)
        worker.padding_budget = COHORT_PADDING_SLOTS
        worker.cohorts = [
            _Cohort([None] * rows, [], torch.ones((rows, width), dtype=torch.bool))  # type: ignore[list-item]
            for rows, width in shapes
        ]
        worker._consolidate()
        model = Cohorts(COHORT_PADDING_SLOTS)
        for rows, width in shapes:
            for _ in range(rows):
                model.join(1000.0 - width)
        assert model.count(1000.0) == len(worker.cohorts), shapes
