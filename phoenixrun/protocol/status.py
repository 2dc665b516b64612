"""The control API's answers: one HTTP status per outcome, so a caller reads the code, not an error string.

Every refusal also carries a JSON body {"error": what was wrong and what to do, "reason": a category}; a
caller decides on the status alone. 2xx: done (a heartbeat's reply may still say `fenced`: that is an order,
not an error). 4xx: this message was refused and sending it again unchanged gets the same answer - except
UNKNOWN_NODE, which asks the node to register first and then try again.
"""
from __future__ import annotations

from enum import IntEnum


class Status(IntEnum):
    OK = 200
    BAD_REQUEST = 400            # not JSON, not an object, or an invalid message (protocol/messages.py)
    UNAUTHORIZED = 401           # missing or wrong job secret (the connection is closed)
    WRONG_TOKEN = 403            # the call does not carry the token of its node's registration
    NO_SUCH_ENDPOINT = 404
    METHOD_NOT_ALLOWED = 405     # GET and POST only
    READ_TIMEOUT = 408           # the request was not completed in time (constants.READ_TIMEOUT_S)
    CONFLICT = 409               # valid, but contrary to the master's state: a generation it never issued, a node
    #                              id already in use, a slot with no active node, workers_done never ordered
    UNKNOWN_NODE = 410           # the master has no record of this node (it restarted): register (rejoin), then retry
    TOO_LARGE = 413              # body over constants.MAX_BODY, or data sent ahead of the replies
    HEAD_TOO_LARGE = 431         # request head over constants.MAX_HEAD
    MASTER_ERROR = 500           # a bug in the master's handler: it keeps serving everyone else



def refused(code: int | None) -> bool:
    """A refusal of the message itself (sending it again unchanged will not help): a 4xx other than UNKNOWN_NODE.
    None (the master was not reached) is not a refusal."""
    return code is not None and 400 <= code < 500 and code != Status.UNKNOWN_NODE


# the reason phrases the master's transport sends (its status lines are part of the wire: unchanged)
REASON_PHRASES = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
                  405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict", 410: "Gone",
                  413: "Payload Too Large", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
                  503: "Service Unavailable"}
