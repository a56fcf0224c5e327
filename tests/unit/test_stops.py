from thunderagent.frontend.stops import StopMatcher


def run(stops, pieces):
    m = StopMatcher(stops)
    out = [m.feed(p) for p in pieces]
    return out, m.stopped, m.flush()


def test_no_stops_passes_through():
    assert run([], ["ab", "cd"]) == (["ab", "cd"], False, "")


def test_stop_across_chunks_is_never_leaked():
    out, stopped, rest = run(["END"], ["hello E", "N", "D more"])
    assert "".join(out) == "hello " and stopped and rest == ""
    assert out[0] == "hello"  # " E" held back: the longest stop is 3 chars


def test_held_text_released_when_no_match():
    out, stopped, rest = run(["END"], ["abcE", "x"])
    assert out == ["ab", "c"] and not stopped and rest == "Ex"


def test_earliest_of_several_stops_wins():
    out, stopped, _ = run(["zz", "b"], ["aabzz"])
    assert out == ["aa"] and stopped
