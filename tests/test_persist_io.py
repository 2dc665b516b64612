"""protocol/persist_io.py: the agent and its checkpoint I/O process exchange typed lines - each round-trips
through JSON, a line that is not one is refused naming what is wrong, and the I/O process (its real `serve` loop)
answers a bad request with a Failed answer and goes on serving."""
from __future__ import annotations

import io
import json

import pytest

from phoenixrun.agents import persist_worker
from phoenixrun.protocol import persist_io as pio


def _json(x):
    return json.loads(json.dumps(x.to_wire()))


@pytest.mark.parametrize("req", [pio.WriteImage(3, "/dev/shm/x-persist-r3-40"), pio.ReadImage(0, 40, "/dev/shm/y")])
def test_a_request_decodes_to_what_the_agent_built(req):
    assert pio.decode_request(_json(req)) == req


@pytest.mark.parametrize("answer", [pio.Ready(), pio.Done(40, (10, 20)), pio.Done(7), pio.Failed("disk full")])
def test_an_answer_decodes_to_what_the_io_process_built(answer):
    assert pio.decode_answer(_json(answer)) == answer


@pytest.mark.parametrize("line, named", [
    ({"op": "write", "rank": 0}, "image"), ({"op": "read", "rank": 0, "out": "/o"}, "step"),
    ({"op": "read", "rank": -1, "step": 1, "out": "/o"}, "rank"), ({"op": "erase"}, "unknown op"), ([], "object"),
])
def test_a_request_that_is_not_one_is_refused_by_name(line, named):
    with pytest.raises(ValueError, match=named):
        pio.decode_request(line)


def test_the_io_process_answers_a_bad_request_and_goes_on(tmp_path):
    lines = [json.dumps({"op": "erase", "rank": 0}), json.dumps(pio.ReadImage(0, 5, str(tmp_path / "out")).to_wire())]
    out = io.StringIO()
    persist_worker.serve(tmp_path / "ckpt", world_size=1, keep=2, inp=lines, out=out)
    got = [pio.decode_answer(json.loads(x)) for x in out.getvalue().splitlines()]
    assert got[0] == pio.Ready() and len(got) == 3
    assert isinstance(got[1], pio.Failed) and "unknown op" in got[1].error
    assert isinstance(got[2], pio.Failed)            # nothing on disk at step 5: refused, not a crash
