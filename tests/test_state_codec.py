"""runtime/state_codec.py: the state dict's JSON, and the warning when it grows with the run (issue 31 item 6)."""
import json

from phoenixrun.runtime.state_codec import SizeWatch, encode_state


def test_encoding_is_the_json_of_the_state():
    state = {"losses": {"0": 1.5, "1": 0.25}, "n": 2, "name": "x"}
    text, seconds = encode_state(state)
    assert json.loads(text) == state and text == json.dumps(state) and seconds >= 0


def test_warns_past_the_bound_then_once_per_doubling():
    w = SizeWatch(1000)
    assert w.check(999, 0.001, 1) is None
    msg = w.check(1000, 0.002, 2)
    assert msg and "1000 bytes" in msg and "step 2" in msg and "2.0 ms" in msg
    # a state growing 10 bytes a step up to 1 MB: one warning per doubling, a logarithmic number of lines
    warned = [n for n in range(1010, 1_000_000, 10) if w.check(n, 0.0, n)]
    assert warned == [2000, 4000, 8000, 16000, 32000, 64000, 128000, 256000, 512000]
    assert w.check(500, 0.0, 0) is None      # a state that shrank says nothing
