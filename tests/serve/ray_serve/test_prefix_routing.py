"""``PrefixAffinity`` (``serve/ray_serve/prefix_routing.py``), the choice behind the Ray Serve
application's router, without Ray: a prompt goes to the replica that was sent the longest run of
its leading blocks, unless that replica is too much busier than the least loaded; else to the
least loaded, and among equals to the one sent the fewest prompts. Its memory is bounded."""

from __future__ import annotations

import pytest

from compiled_llm.serve.ray_serve.prefix_routing import PrefixAffinity, PrefixRoutingConfig

SYSTEM = list(range(100, 148))  # three full blocks of 16


def test_a_prompt_goes_to_the_replica_that_holds_the_longest_run_of_its_leading_blocks():
    a = PrefixAffinity()
    assert a.route(SYSTEM + [1, 2], ["r0", "r1"]) == "r0"
    assert a.route([7] * 56, ["r0", "r1"]) == "r1"  # nothing matched: the one sent fewer prompts
    assert a.route(SYSTEM[:16] + [9] * 40, ["r0", "r1"]) == "r0"  # one leading block matched there
    assert a.route([7] * 48 + SYSTEM, ["r0", "r1"]) == "r1"  # three there
    assert a.matched_blocks(a.block_hashes([9] * 16 + SYSTEM), "r0") == 0  # a shared middle is no prefix
    assert a.block_hashes(SYSTEM[:15]) == []  # no full block: nothing to match or remember


def test_without_a_match_the_least_loaded_replica_and_then_the_one_sent_fewest_prompts_wins():
    a = PrefixAffinity()
    load = {"r0": 2, "r1": 0, "r2": 1}
    assert a.route([1, 2, 3], ["r0", "r1", "r2"], load.__getitem__) == "r1"
    fresh = PrefixAffinity()
    assert [fresh.route([i], ["r0", "r1"]) for i in range(4)] == ["r0", "r1", "r0", "r1"]


def test_a_cached_prefix_yields_to_the_least_loaded_past_the_allowed_imbalance():
    a = PrefixAffinity(PrefixRoutingConfig(max_imbalance=2))
    a.record(SYSTEM, "r0")
    assert a.choose(SYSTEM, ["r0", "r1"], {"r0": 2, "r1": 0}.__getitem__) == "r0"
    assert a.choose(SYSTEM, ["r0", "r1"], {"r0": 3, "r1": 0}.__getitem__) == "r1"


def test_text_prompts_are_matched_by_blocks_of_characters_and_hashes_are_stable():
    a = PrefixAffinity(PrefixRoutingConfig(text_block_chars=8))
    text = "You are a helpful assistant. " * 2
    assert a.route(text + "Hi", ["r0", "r1"]) == "r0"
    assert a.route("unrelated text here", ["r0", "r1"]) == "r1"
    assert a.route(text + "Bye", ["r0", "r1"]) == "r0"
    # the same in any process (str's hash() is salted per process; these are not)
    assert PrefixAffinity().block_hashes(list(range(16))) == [PrefixAffinity().block_hashes(list(range(16)))[0]]
    assert a.block_hashes("abcdefgh") != a.block_hashes(list(b"abcdefgh"))


def test_each_replica_remembers_a_bounded_number_of_blocks_and_a_gone_one_is_forgotten():
    a = PrefixAffinity(PrefixRoutingConfig(max_blocks_per_replica=3))
    a.record(SYSTEM, "r0")  # three blocks
    a.record([5] * 16, "r0")  # a fourth pushes out the oldest chain's deepest block: its head still matches
    assert a.matched_blocks(a.block_hashes(SYSTEM), "r0") == 2
    assert a.matched_blocks(a.block_hashes([5] * 16), "r0") == 1
    a.forget("r0")
    assert a.matched_blocks(a.block_hashes([5] * 16), "r0") == 0
    with pytest.raises(ValueError, match="block_size must be a whole number >= 1"):
        PrefixRoutingConfig(block_size=0)
    with pytest.raises(ValueError, match="no replica"):
        a.choose(SYSTEM, [])
