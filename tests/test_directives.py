"""The directive board: versions, shared broadcast encodings, acks."""
import json
import time

from phoenixrun.control.directives import DirectiveBoard


def test_broadcast_is_one_version_and_one_encoding():
    board = DirectiveBoard(first_version=100)
    ids = board.set(["a", "b", "c"], command="quiesce", generation=2)
    assert ids == ["a", "b", "c"]
    bodies = {board.get(n).body for n in ids}
    assert len(bodies) == 1                                   # encoded once, shared
    assert json.loads(bodies.pop()) == {"command": "quiesce", "generation": 2, "version": 101}


def test_versions_grow_and_each_node_keeps_only_its_newest():
    board = DirectiveBoard(first_version=0)
    board.set(["a"], command="run", slot=0)
    board.set(["b"], command="run", slot=1)
    board.set(["a"], command="quiesce")
    assert board.get("a").version == 3 and board.get("a").fields["command"] == "quiesce"
    assert board.get("b").version == 2
    assert board.get("zzz") is None


def test_answer_gives_newer_directives_and_records_the_ack():
    board = DirectiveBoard(first_version=10)
    assert board.answer("a", -1) is None                      # nothing for it yet: park
    board.set(["a"], command="run")
    d = board.get("a")
    assert json.loads(board.answer("a", -1))["version"] == 11
    assert json.loads(board.answer("a", 5))["command"] == "run"
    assert not d.acked
    assert board.answer("a", 11) is None and d.acked          # it holds the current one: ack, park
    assert board.answer("a", 12) is None                      # claims a newer one (older master): park


def test_first_version_is_the_clock_so_a_restarted_master_outranks_the_old_one():
    before = int(time.time() * 1e6)
    assert DirectiveBoard().version >= before
