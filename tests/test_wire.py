"""The master's JSON codec: orjson where installed, the same JSON either way."""
import json
import math

import pytest

from phoenixrun.control import wire


@pytest.fixture(autouse=True, params=["orjson", "stdlib"])
def codec(request, monkeypatch):
    """Every test runs with orjson (when installed) and with the stdlib fallback."""
    if request.param == "stdlib":
        monkeypatch.setattr(wire, "orjson", None)
    elif wire.orjson is None:
        pytest.skip("orjson not installed")


def test_round_trip_with_int_keys_as_the_stdlib_writes_them():
    obj = {"fetch": {3: {"holder": "h:1"}}, "slots": {0: "a:1"}, "ok": True, "x": 1.5}
    assert json.loads(wire.dumps(obj)) == json.loads(json.dumps(obj))
    assert wire.loads(wire.dumps(obj)) == {"fetch": {"3": {"holder": "h:1"}}, "slots": {"0": "a:1"}, "ok": True,
                                           "x": 1.5}


def test_accepts_what_stdlib_clients_send():
    # an agent's json.dumps writes NaN for a non-finite float: the master must still read the report
    assert math.isnan(wire.loads(json.dumps({"loss": float("nan")}).encode())["loss"])


def test_bad_json_is_a_value_error():
    with pytest.raises(ValueError):
        wire.loads(b"{not json")
