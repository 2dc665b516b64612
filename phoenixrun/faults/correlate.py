"""Root cause vs symptom across nodes, as a pure function over one correlation window.

When a node dies, every survivor's collective fails too. The master collects the signals of a short window
(collecting and timing the window is the caller's job) and calls ``correlate`` once it closes:

1. Nodes with a definite root cause (exit by signal, lost heartbeat, Xid, ECC, user exception, ...) are acted on
   with their own classification. Every other reporting node is a SYMPTOM: it only quiesces and keeps its
   processes - survivors are never blamed.
2. Else, nodes with only ambiguous root causes (hang, non-zero exit without text) are acted on; nodes with only
   collective errors are symptoms of them.
3. Else (collective errors only): the fault was transient; every reporting node gets a local reset (or
   node_replace where its local resets already repeat past the limit).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping

from .classify import DEFAULT_INCIDENT_GAP_S, DEFAULT_MAX_LOCAL_RESETS, classify
from .taxonomy import ACTION_PRECEDENCE, Action, Classification, Signal


class Verdict(str, Enum):
    ROOT_CAUSE = "root_cause"  # act on the node with ``NodeDecision.action``
    SYMPTOM = "symptom"  # quiesce only: abandon the step, keep processes, wait for the repair
    TRANSIENT = "transient"  # collective errors with no root cause anywhere: act with ``action`` (local reset)


@dataclass(frozen=True)
class NodeDecision:
    node: int
    verdict: Verdict
    action: Action | None  # None for SYMPTOM
    classification: Classification  # of ``signal``, the signal that decided
    signal: Signal
    signals: tuple[Signal, ...]  # all of this node's signals in the window, in arrival order

    @property
    def reason(self) -> str:
        return f"{self.verdict.value}: {self.classification.reason}"

    @property
    def acted_action(self) -> Action:
        """The action of a decision acted on (a root cause or a transient; a symptom has none)."""
        if self.action is None:
            raise ValueError(f"node {self.node}: a symptom carries no action")
        return self.action


@dataclass(frozen=True)
class Correlation:
    decisions: tuple[NodeDecision, ...]  # one per reporting node, sorted by node

    @property
    def acted_on(self) -> tuple[NodeDecision, ...]:
        return tuple(d for d in self.decisions if d.verdict is not Verdict.SYMPTOM)

    @property
    def symptoms(self) -> tuple[NodeDecision, ...]:
        return tuple(d for d in self.decisions if d.verdict is Verdict.SYMPTOM)

    @property
    def external_fallback(self) -> bool:
        """True: some node's fault cannot be hot-swapped away; the job must stop or restart from disk."""
        return any(d.action is Action.EXTERNAL_FALLBACK for d in self.decisions)

    def nodes(self, action: Action) -> list[int]:
        return [d.node for d in self.decisions if d.action is action]

    def decision(self, node: int) -> NodeDecision | None:
        return next((d for d in self.decisions if d.node == node), None)


_Pair = tuple[Classification, Signal]


def _pick(pairs: list[_Pair]) -> _Pair:
    # Costliest action wins; among equals the earliest signal (the likeliest cause).
    return max(pairs, key=lambda p: (ACTION_PRECEDENCE[p[0].action], -p[1].timestamp))


def _definite(c: Classification) -> bool:
    return c.root_cause and not c.ambiguous


def _ambiguous(c: Classification) -> bool:
    return c.root_cause and c.ambiguous


def correlate(
    signals: Iterable[Signal],
    history: Mapping[int, Iterable[Signal]] | None = None,
    *,
    max_local_resets: int = DEFAULT_MAX_LOCAL_RESETS,
    incident_gap_s: float = DEFAULT_INCIDENT_GAP_S,
) -> Correlation:
    """Decide, per reporting node, what to do about one window of signals.

    ``history`` maps a node to its earlier signals (for escalation, see ``classify``). Every signal must name
    its node.
    """
    history = history or {}
    by_node: dict[int, list[_Pair]] = defaultdict(list)
    for s in signals:
        if s.node is None:
            raise ValueError(f"signal without a node cannot be correlated: {s}")
        hist = tuple(history.get(s.node, ()))
        c = classify(s, hist, max_local_resets=max_local_resets, incident_gap_s=incident_gap_s)
        by_node[s.node].append((c, s))

    # The strongest tier of evidence present anywhere decides which nodes are acted on.
    tier = None
    for pred in (_definite, _ambiguous):
        if any(pred(c) for pairs in by_node.values() for c, _ in pairs):
            tier = pred
            break

    decisions = []
    for node in sorted(by_node):
        pairs = by_node[node]
        sigs = tuple(s for _, s in pairs)
        if tier is None:
            c, s = _pick(pairs)
            decisions.append(NodeDecision(node, Verdict.TRANSIENT, c.action, c, s, sigs))
            continue
        own = [p for p in pairs if tier(p[0])]
        if own:
            c, s = _pick(own)
            decisions.append(NodeDecision(node, Verdict.ROOT_CAUSE, c.action, c, s, sigs))
        else:
            c, s = min(pairs, key=lambda p: p[1].timestamp)
            decisions.append(NodeDecision(node, Verdict.SYMPTOM, None, c, s, sigs))
    return Correlation(tuple(decisions))
