"""A failed worker's own words when it did not tell its agent (agents/failure_text.py), and what the classifier
makes of them: the rank that raised is the root cause, the peer whose collective then failed a symptom."""
import json

import pytest

from phoenixrun.agents.failure_text import MAX_TEXT, error_file_message, failure_text, last_traceback
from phoenixrun.faults.classify import classify
from phoenixrun.faults.taxonomy import Action, Signal, SignalKind

RAISER = """[W1205 12:00:00] some warning printed earlier: Broken pipe in a progress bar
Traceback (most recent call last):
  File "train.py", line 52, in <module>
    raise RuntimeError(f"rank {rank} fails once at step {step}")
RuntimeError: rank 1 fails once at step 3
"""
SURVIVOR = """Traceback (most recent call last):
  File "train.py", line 48, in <module>
    loss.backward()
RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41235
"""
RECORD = json.dumps({"message": {"message": "ValueError: bad batch", "extraInfo": {"timestamp": "1796487415"}}})


@pytest.mark.parametrize("raw, message", [
    (RECORD, "ValueError: bad batch"),                       # what torchelastic's @record writes
    (json.dumps({"message": "OSError: disk full"}), "OSError: disk full"),
    ("not json", ""), ("[]", ""), (json.dumps({"message": {"extraInfo": {}}}), ""), ("{}", ""),
])
def test_an_error_file_gives_its_message(raw, message):
    assert error_file_message(raw) == message


@pytest.mark.parametrize("tail, text", [
    (RAISER, RAISER[RAISER.index("Traceback"):].strip()),    # the last traceback, not the warnings before it
    (SURVIVOR + RAISER, RAISER[RAISER.index("Traceback"):].strip()),
    ("killed: out of memory\n", "killed: out of memory"),    # no traceback: what it printed last
    ("", ""),
])
def test_the_last_traceback_is_the_failure(tail, text):
    assert last_traceback(tail) == text


def test_a_long_traceback_keeps_its_end():
    text = last_traceback("Traceback (most recent call last):\n" + "x" * (3 * MAX_TEXT) + "\nValueError: the end")
    assert len(text) == MAX_TEXT and text.endswith("ValueError: the end")


def test_the_error_file_wins_and_an_empty_one_falls_back_to_stderr():
    assert failure_text(RECORD, SURVIVOR) == "ValueError: bad batch"
    assert failure_text("{}", SURVIVOR).endswith("Connection closed by peer [127.0.0.1]:41235")
    assert failure_text(None, RAISER).endswith("rank 1 fails once at step 3")


def exit_with(text: str):
    return classify(Signal(SignalKind.WORKER_EXIT, node=0, rank=0, code=1, detail=text))


def test_the_rank_that_raised_is_the_root_cause_and_its_peer_a_symptom():
    raiser, survivor = exit_with(failure_text(None, RAISER)), exit_with(failure_text(None, SURVIVOR))
    assert raiser.root_cause and not raiser.ambiguous and raiser.action is Action.EXTERNAL_FALLBACK
    assert not survivor.root_cause and survivor.action is Action.LOCAL_RESET
