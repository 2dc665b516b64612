"""What a failed worker said about its failure, when it did not tell its agent (a script without the API).

A worker of a script using the API sends its exception to the agent before it exits. A plain torchrun script
does not, and its exit code alone cannot tell the rank that raised from a peer whose collective then failed:
both exit with code 1 (CI saw the survivor's exit reach the master first and be blamed for the fault). What
each one printed can: torchelastic's @record error file if the script wrote one, else the last Python
traceback on its stderr. The classifier reads that text (faults/classify.py: a collective error is a
symptom). Pure.
"""
from __future__ import annotations

import json

TRACEBACK = "Traceback (most recent call last):"
MAX_TEXT = 4000     # characters kept: the end of a traceback names the exception


def error_file_message(raw: str) -> str:
    """The message of a torchelastic error file (`{"message": {"message": ..., "extraInfo": ...}}` as written
    by @record, or `{"message": "..."}`), "" if it holds none."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return ""
    msg = doc.get("message") if isinstance(doc, dict) else None
    if isinstance(msg, dict):
        msg = msg.get("message")
    return msg if isinstance(msg, str) else ""


def last_traceback(err_tail: str) -> str:
    """The last Python traceback in the end of a worker's stderr, from its first line; else the last lines of
    what it printed; at most MAX_TEXT characters, the end kept."""
    i = err_tail.rfind(TRACEBACK)
    text = err_tail[i:] if i >= 0 else err_tail
    return text.strip()[-MAX_TEXT:]


def failure_text(error_file: str | None, err_tail: str) -> str:
    """Why a worker that exited non-zero failed, in its own words: its error file's message, else its stderr's
    last traceback."""
    return (error_file_message(error_file) if error_file else "") or last_traceback(err_tail)
