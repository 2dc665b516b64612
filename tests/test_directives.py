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
    assert board.get("a").version == 3 and board.get("a").command == "quiesce"
    assert board.get("b").version == 2
    assert board.get("zzz") is None


def test_answer_gives_newer_directives_and_records_the_ack():
    board = DirectiveBoard(first_version=10)
    assert board.answer("a", -1) is None                      # nothing for it yet: park
    board.set(["a"], command="run")
    d = board.get("a")
    assert board.answer("a", -1) is d and json.loads(d.body)["version"] == 11
    assert board.answer("a", 5) is d and d.command == "run"
    assert not d.acked
    assert board.answer("a", 11) is None and d.acked          # it holds the current one: ack, park
    assert board.answer("a", 12) is None                      # claims a newer one (older master): park


def test_first_version_is_the_clock_so_a_restarted_master_outranks_the_old_one():
    before = int(time.time() * 1e6)
    assert DirectiveBoard().version >= before


def test_a_version_is_reported_once_sent_to_every_node_it_was_set_for():
    sent = []
    board = DirectiveBoard(first_version=0, on_sent=lambda r, t: sent.append((r.command, r.generation, r.targets)))
    board.set(["a", "b"], command="quiesce", generation=3)
    a = board.answer("a", -1)
    assert a is not None and sent == []                         # answered, not yet written: not sent
    board.mark_sent(a)
    board.mark_sent(board.answer("a", -1))                      # "a" again (a retried poll): counted once
    assert sent == []
    board.mark_sent(board.answer("b", 0))
    assert sent == [("quiesce", 3, 2)]
    board.set_each({"a": {"slot": 0}, "b": {"slot": 1}}, command="restore", generation=3)
    stale = board.get("a")
    board.set(["a"], command="stop")                            # "a" superseded before it got the restore
    board.mark_sent(board.answer("b", 1))
    assert len(sent) == 1                                        # the restore never reached "a": not reported
    board.mark_sent(stale)                                       # ... unless it was answered before the stop
    assert sent[-1] == ("restore", 3, 2)


def test_set_each_shares_one_encoding_among_nodes_with_nothing_of_their_own():
    board = DirectiveBoard(first_version=0)
    board.set_each({"a": {"slot": 0, "world": {"slots": {0: "h:1"}}}, "b": {}, "c": {}}, command="restore",
                   restore_step=7)
    a, b, c = (board.get(n) for n in "abc")
    assert a.version == b.version == c.version == 1
    assert b.body is c.body and a.body is not b.body
    assert json.loads(a.body) == {"command": "restore", "restore_step": 7, "version": 1, "slot": 0,
                                  "world": {"slots": {"0": "h:1"}}}
    assert json.loads(b.body) == {"command": "restore", "restore_step": 7, "version": 1}
