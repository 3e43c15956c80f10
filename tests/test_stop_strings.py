from tp_engine.frontend.stop_strings import find_stop_string


def test_earliest_stop_string_wins():
    assert find_stop_string("abc###def\n\n", ["\n\n", "###"]) == (3, "###")
    assert find_stop_string("abc", ["x", "bc"]) == (1, "bc")
    assert find_stop_string("abc", ["x"]) is None
    assert find_stop_string("", ["x"]) is None
