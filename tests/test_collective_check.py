"""A collective only some ranks issue after a recovery fails at once, naming the op and call site on every rank
(runtime/collective_check.py): the record's encoding and the verdict as pure functions, then two members with real
gloo backends (threads of this process, as tests/test_generations.py runs them)."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from phoenixrun.runtime.collective_check import (CHECKS, FROM_CPP, RECORD_BYTES, CollectiveMismatch, Issued,
                                                 call_site, decode, encode, mismatch)
from phoenixrun.runtime.generations import GlooGeneration
from tests.test_generations import both, members, store  # noqa: F401 - the fixture


@pytest.mark.parametrize("issued", [
    Issued("allreduce", "/x/train.py:12 in main"),
    Issued("_allgather_base", FROM_CPP),
    Issued("broadcast", ""),
    Issued("barrier", "/site-packages/accelerate/utils/random.py:88 in synchronize_rng_state"),
])
def test_a_record_round_trips(issued):
    t = encode(issued)
    assert t.dtype == torch.uint8 and t.numel() == RECORD_BYTES
    assert decode(t) == issued


def test_a_long_call_site_keeps_its_end():
    site = "/very/long/" + "d/" * 200 + "train.py:77 in step"
    got = decode(encode(Issued("allreduce", site))).site
    assert got.startswith("...") and got.endswith("train.py:77 in step") and len(got.encode()) <= RECORD_BYTES


MISMATCH = [
    # (records, members, verdict: None or substrings of the message)
    ([Issued("allreduce", "a"), Issued("allreduce", "b")], None, None),      # the same op from other lines: fine
    ([Issued("broadcast", "a")], None, None),
    ([Issued("broadcast", "/acc/data_loader.py:5 in __iter__"), Issued("allreduce", FROM_CPP)], None,
     ["rank 0: broadcast at /acc/data_loader.py:5 in __iter__", "rank 1: allreduce at from C++",
      "before phoenixrun.protect()"]),
    ([Issued("allreduce", "x"), Issued("allreduce", "x"), Issued("barrier", "y")], (4, 5, 6),
     ["rank 4: allreduce", "rank 6: barrier at y"]),                          # a subgroup: its members' global ranks
]


@pytest.mark.parametrize("records,ranks,verdict", MISMATCH)
def test_the_verdict(records, ranks, verdict):
    msg = mismatch(records, ranks)
    if verdict is None:
        assert msg is None
    else:
        assert all(s in msg for s in verdict), msg
        # never read as a collective failure (that would hot-swap in a loop instead of stopping)
        from phoenixrun.faults.classify import is_collective_error_text
        assert not is_collective_error_text(msg)


def test_the_call_site_is_the_first_frame_outside_torch_and_phoenixrun():
    site = call_site()
    assert site.startswith(__file__) and "test_the_call_site" in site


TIMEOUT = timedelta(seconds=20)


def test_members_that_issue_different_collectives_fail_at_once_naming_both(store):  # noqa: F811
    m = members(GlooGeneration, store)
    both(lambda r: m[r][2].connect(1, "/test/check-gen1/"))
    world = [m[0][0].world, m[1][0].world]
    try:
        CHECKS.arm()
        # armed: the same op on both members runs after the comparison, with the op's own result
        t = both(lambda r: (world[r].allreduce([x := torch.tensor([r + 1.0])]).wait(), x.item())[1])
        assert t == [3.0, 3.0]

        def rogue(r):
            x = torch.zeros(2)
            if r == 0:    # the replacement's lone broadcast
                return world[r].broadcast([x]).wait()
            return world[r].allreduce([x]).wait()
        errors = []

        def caught(r):
            try:
                rogue(r)
            except CollectiveMismatch as e:
                errors.append(str(e))
        both(caught)
        assert len(errors) == 2, errors
        for e in errors:
            assert "rank 0: broadcast at" in e and "rank 1: allreduce at" in e and __file__ in e, e
        assert not CHECKS.armed
    finally:
        CHECKS.disarm()
        for _, _, g in m:
            g.close()
