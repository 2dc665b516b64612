"""docs/design.md states the contracts the code relies on; here the parts a machine can check are held to the code:
its event table names exactly the events the master writes (protocol.names.Event), and it names every fault
class and action (faults.taxonomy)."""
from __future__ import annotations

import re
from pathlib import Path

from phoenixrun.faults.taxonomy import Action, FaultClass
from phoenixrun.protocol.names import Event

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def event_table(text: str) -> list[str]:
    """The event names in the first column of the table under "## Event contract"."""
    section = text.split("## Event contract", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)


def test_event_table_names_every_event_once():
    names = event_table(DESIGN.read_text())
    assert len(names) == len(set(names)), f"listed twice: {sorted({n for n in names if names.count(n) > 1})}"
    code = {e.value for e in Event}
    assert set(names) == code, (f"docs/design.md's event table lacks {sorted(code - set(names))} and lists "
                                f"{sorted(set(names) - code)} that the master never writes")


def test_event_table_reader_sees_a_missing_row():
    text = DESIGN.read_text()
    assert "restart" in event_table(text)
    cut = "\n".join(line for line in text.splitlines() if not line.startswith("| `restart` |"))
    assert "restart" not in event_table(cut)


def test_fault_classes_and_actions_are_named():
    text = DESIGN.read_text()
    missing = [v.value for v in (*FaultClass, *Action) if f"`{v.value}`" not in text and f"**{v.value}**" not in text]
    assert not missing, f"docs/design.md does not name {missing}"
