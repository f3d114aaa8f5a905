"""A narrated walk through the Reserve / Occupy / Consume protocol on a small example.

Run it with ``stalebound walkthrough``. It follows the worked example of the PSRL design: six
trajectories start at version 0 with η = 1, so their worst-case place is buffer 1; as they finish
they move to the earliest buffer with room, and buffer 0 becomes READY first.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from stalebound.core import EntryState, StalenessBuffer

_GLYPH = {
    EntryState.OCCUPIED: "[green]■[/]",
    EntryState.RESERVED: "[yellow]▣[/]",
    EntryState.EMPTY: "[dim]□[/]",
}


def _draw(console: Console, buf: StalenessBuffer, caption: str) -> None:
    table = Table(title=caption, title_justify="left", show_edge=False)
    table.add_column("buffer")
    table.add_column("entries (■ occupied ▣ reserved □ empty)")
    table.add_column("state")
    for bv in range(buf.version, buf.version + buf.staleness + 1):
        counts = buf.entries(bv)
        row = "".join(
            _GLYPH[s] * counts[s]
            for s in (EntryState.OCCUPIED, EntryState.RESERVED, EntryState.EMPTY)
        )
        marker = " ← trained next" if bv == buf.version else ""
        table.add_row(f"v{bv}{marker}", row, buf.state(bv).name)
    console.print(table)
    console.print()


def run(console: Console | None = None) -> StalenessBuffer:
    """Play the example and return the buffer at the end (the tests check it)."""
    console = console or Console()
    say = console.print
    buf = StalenessBuffer(batch_size=6, staleness=1, start_version=1)
    say("[bold]stalebound walkthrough[/]: B = 6 groups per step, η = 1, training version v = 1\n")
    for i in range(1, 7):
        buf.try_reserve(f"t{i}")
    _draw(console, buf, "Reserve t1…t6 at V = 1: each takes its worst case, buffer V + η = 2")
    for i in range(1, 6):
        say(f"t{i} finished → occupy moves it to buffer {buf.occupy(f't{i}')} (earliest with room)")
    _draw(console, buf, "Five finished early: buffer 1 fills while t6 is still generating")
    for i in range(7, 13):
        r = buf.try_reserve(f"t{i}")
        say(f"reserve t{i} → buffer {r.buffer_version if r else 'none: no capacity'}")
    _draw(console, buf, "Six more start: the latest buffer with room first, so t12 lands in 1")
    say(f"t6 (the straggler) finished → buffer {buf.occupy('t6')}: buffer 1 is full of others")
    say(f"t12 finished → buffer {buf.occupy('t12')}; buffer 1 is now {buf.state(1).name}")
    _draw(console, buf, "")
    batch = buf.consume()
    say(
        f"consume() trains {[g.group_id for g in batch.groups]} at version {batch.version} "
        f"(staleness {batch.staleness()}); the version is now {buf.version}\n"
    )
    _draw(console, buf, "Buffer 3 came into the window; t6 will be trained at 2, staleness 1 ≤ η")
    stats = buf.statistics()
    say(
        f"reserved {stats.reserved_total}, consumed {stats.consumed_groups}, in flight "
        f"{len(buf)}, capacity now {stats.capacity}, staleness histogram "
        f"{dict(stats.staleness_histogram)}"
    )
    return buf
