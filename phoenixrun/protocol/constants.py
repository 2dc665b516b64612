"""The protocol's limits and timeouts: what both ends of a connection must agree on, defined once.

Tuning that only one side sees (the server's listen backlog, how many polls it answers per loop turn, the
agent's watch interval) stays with that side.
"""
from __future__ import annotations

import signal

# ------------------------------------------------------------------ the control API (HTTP, control/server.py)
# What a peer can make the master hold (measured on main at 73f19fc: 60 unauthenticated connections sending
# 16 MiB bodies took it from 233 MB to 1.3 GB): before authentication at most MAX_HEAD bytes per connection
# and at most MAX_UNAUTHENTICATED such connections; a request head or body that does not complete within
# READ_TIMEOUT_S is dropped; authenticated bodies are at most MAX_BODY (the largest real message, a rejoin or
# a quiesce ack of a node with many ranks, is a few KiB).
MAX_HEAD = 8 * 1024
MAX_BODY = 1024 * 1024
MAX_UNAUTHENTICATED = 4096        # connections that have not yet sent an authenticated request head
READ_TIMEOUT_S = 10.0             # to complete a request once its first byte (or the connection) is there
CLIENT_TIMEOUT_S = 5.0            # a control client's default time to get an answer

# ------------------------------------------------------------------ message fields (protocol/messages.py)
MAX_ID = 200                      # node ids, hosts, fault domains
MAX_TEXT = 8192                   # free text (exception tails): more is cut, not refused
MAX_LIST = 4096                   # steps per rank, worker pids: a node never has more
MAX_GENERATION = 1 << 31          # generations count recovery cycles: 2^31 is never reached honestly
MAX_COUNT = 1 << 31
MAX_CLOCK_SKEW_S = 3600.0         # a report's `t` further than this from the master's clock is replaced by it

# ------------------------------------------------------------------ the directive long-poll (/v1/directive)
MAX_POLL_TIMEOUT = 3600.0         # the most a poll may ask to be held
DEFAULT_POLL_TIMEOUT_S = 10.0     # a poll that names no timeout
MAX_PARKED_POLL_S = 30.0          # the master holds a poll at most this long (answering after 50-100% of it)
# The agent's poll timeout: the master answers it at once when it has an order, else when this passes (it
# answers after 50-100% of it). Long, because each expiry is a re-poll, and an agent between two polls gets a
# broadcast only once its re-poll is read: at 16K agents, 10 s meant ~2,200 re-polls a second and a tail of
# late agents on every broadcast. A dead master connection fails the poll at once; a silent one at +5 s.
DIRECTIVE_POLL_S = 30.0

# ------------------------------------------------------------------ worker stacks (runtime/stacks.py)
# The signal an agent sends a managed worker it is about to kill for not answering (a quiesce it did not
# acknowledge): the worker's runtime has faulthandler print every thread's Python stack to its stderr on it.
# A real-time signal, not SIGUSR1/2, which scripts and frameworks use for their own ends (Lightning's Slurm
# requeue is SIGUSR1). STACK_DUMP_WAIT_S: how long the agent lets it write before the kill (the handler writes
# synchronously, in C, even while a thread is blocked inside a collective).
STACK_SIGNAL_OFFSET = 6           # signal.SIGRTMIN + this
STACK_DUMP_WAIT_S = 0.2


def stack_signal() -> int:
    """The stack signal's number (both the agent, which sends it, and the worker's runtime need it)."""
    return int(signal.SIGRTMIN) + STACK_SIGNAL_OFFSET
