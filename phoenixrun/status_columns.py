"""Which columns of a `phoenixrun status` table fit a terminal: the least important are left out whole, so the
rest stay readable (rich otherwise narrows every column until each reads "..."). Pure."""
from __future__ import annotations

from dataclasses import dataclass

# what each column costs beyond its text in a rich table with borders: a separator and one space either side
COLUMN_OVERHEAD = 3
# a column whose text may wrap (free text: faults, details) is given at least this many characters
WRAP_MIN = 16


@dataclass(frozen=True)
class Column:
    header: str
    priority: int          # 0: always shown; higher: left out sooner
    wrap: bool = False     # free text that may wrap onto several lines


def needed(col: Column, cells: list[str]) -> int:
    """The characters a column needs: its header and its widest cell, or (free text) a few words of it."""
    body = max((len(c) for c in cells), default=0)
    return max(len(col.header), min(body, WRAP_MIN) if col.wrap else body)


def widths(columns: list[Column], rows: list[list[str]]) -> list[int]:
    """needed() of every column. Pure."""
    return [needed(c, [r[i] for r in rows]) for i, c in enumerate(columns)]


def fit(columns: list[Column], rows: list[list[str]], width: int) -> list[int]:
    """The indices (in order) of the columns to show in `width` characters: all if they fit, else without the
    lowest-priority ones (the later of two equal ones first) until they do. Priority 0 is kept even if it
    does not fit."""
    cost = [w + COLUMN_OVERHEAD for w in widths(columns, rows)]
    kept = list(range(len(columns)))
    for i in sorted(kept, key=lambda i: (-columns[i].priority, -i)):
        if sum(cost[k] for k in kept) + 1 <= width or columns[i].priority == 0:
            break
        kept.remove(i)
    return kept
