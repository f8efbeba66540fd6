"""The data-parallel routers on their own (prefix hashes, the per-replica memory, the choice between
the cached replica and the least loaded; round-robin; the server option that picks one), and
where each replica runs."""

from __future__ import annotations

import pytest

from compiled_llm.errors import InvalidOptionError
from compiled_llm.serve.engine_process.dp_placement import (check_replica_device, replica_cpu_threads, replica_gpus,
                                                            visible_gpus)
from compiled_llm.serve.engine_process.dp_router import (ROUTERS, PrefixAwareRouter, PrefixMemory, RoundRobinRouter,
                                                         RouterConfig, make_router, overloaded, prefix_block_hashes)
from compiled_llm.serve.server_config import LOAD_BALANCE_METHODS, ServerConfig

BS = 4


def prompt(system: int, user: int, system_blocks: int = 3, user_tokens: int = 2) -> list[int]:
    """A system prompt of ``system_blocks`` full blocks shared by every user of it, then the user's tokens."""
    return [1000 * system + i for i in range(system_blocks * BS)] + [10 ** 6 + 100 * user + i for i in range(user_tokens)]


# ---- hashes and memory ------------------------------------------------------------------------------------


def test_only_full_blocks_are_hashed_and_each_hash_covers_its_whole_prefix():
    ids = list(range(10))
    hashes = prefix_block_hashes(ids, BS)
    assert len(hashes) == 2  # tokens 8 and 9 are no full block
    assert prefix_block_hashes(ids[:8], BS) == hashes
    # the same second block after a different first one is a different prefix
    other = prefix_block_hashes([99, 1, 2, 3] + ids[4:8], BS)
    assert other[0] != hashes[0] and other[1] != hashes[1]
    assert prefix_block_hashes(ids[:3], BS) == ()
    assert len(prefix_block_hashes(list(range(100)), BS, max_blocks=5)) == 5


def test_memory_matches_leading_hashes_only_and_forgets_the_least_recently_used():
    memory = PrefixMemory(capacity=4)
    memory.remember([1, 2, 3])
    assert memory.matched_blocks([1, 2, 3, 4]) == 3
    assert memory.matched_blocks([9, 2, 3]) == 0  # a chain that starts elsewhere matches nothing
    memory.remember([5, 6])  # one over: the oldest chain loses its deepest hash, not its head
    assert len(memory) == 4
    assert memory.matched_blocks([1, 2, 3]) == 2 and memory.matched_blocks([5, 6]) == 2
    memory.remember([7, 8])  # [5, 6] is now the newest chain; [1, 2] loses 2, then 1
    assert memory.matched_blocks([1, 2, 3]) == 0 and memory.matched_blocks([5, 6]) == 2


# ---- the choice -------------------------------------------------------------------------------------------


def test_a_prompt_goes_where_its_prefix_was_sent():
    router = PrefixAwareRouter(2, RouterConfig(block_size=BS))
    first = router.route(prompt(0, 0), 10)
    second = router.route(prompt(1, 0), 10)
    assert first != second  # nothing cached yet: the least loaded
    for user in range(1, 6):
        assert router.route(prompt(0, user), 10) == first
        assert router.route(prompt(1, user), 10) == second


def test_without_a_match_the_least_loaded_replica_is_chosen_and_finishing_frees_load():
    router = PrefixAwareRouter(3, RouterConfig(block_size=BS))
    assert [router.route([7] * 2, n) for n in (50, 20, 30)] == [0, 1, 2]  # shorter than a block: no hash
    assert router.loads == [50, 20, 30]
    assert router.choose(prompt(5, 0)) == 1
    router.finished(0, 50)
    assert router.loads[0] == 0 and router.choose(prompt(5, 0)) == 0


def test_new_prefixes_spread_over_idle_replicas_to_the_one_remembering_least():
    router = PrefixAwareRouter(2, RouterConfig(block_size=BS))
    homes = []
    for system in range(4):  # one request at a time: every replica idle when each comes
        homes.append(router.route(prompt(system, 0), 10))
        router.finished(homes[-1], 10)
    assert homes == [0, 1, 0, 1]
    assert [router.choose(prompt(system, 1)) for system in range(4)] == homes


def test_a_short_shared_preamble_does_not_pull_every_request_to_one_replica():
    # every prompt starts with the same one block (a chat template's preamble), then differs
    router = PrefixAwareRouter(2, RouterConfig(block_size=BS, cache_threshold=0.5))
    preamble = [5] * BS
    chosen = [router.route(preamble + [100 * i + k for k in range(3 * BS)], 10) for i in range(6)]
    assert chosen == [0, 1, 0, 1, 0, 1]


def test_a_match_on_a_replica_running_many_more_requests_goes_to_the_least_loaded_instead():
    config = RouterConfig(block_size=BS, balance_abs_requests=4, balance_rel=1.5)
    router = PrefixAwareRouter(2, config)
    cached = router.route(prompt(0, 0), 10)
    router.requests[cached] = 4  # 4 more than the other: not over the absolute threshold
    assert router.choose(prompt(0, 1)) == cached
    router.requests[cached] = 5  # 5 > 0 + 4 and 5 > 1.5 x 0: overloaded
    assert router.choose(prompt(0, 1)) == 1 - cached
    assert overloaded(50, 0, config) and not overloaded(14, 10, config) and not overloaded(100, 90, config)


def test_requests_that_book_the_whole_context_each_still_follow_their_prefix():
    """A chat request without max_tokens books the context left (tens of thousands of tokens):
    a few of them in flight must not count as an overload; the request count decides."""
    router = PrefixAwareRouter(2, RouterConfig(block_size=BS))
    homes = {router.route(prompt(0, user), 40_000) for user in range(6)}
    assert len(homes) == 1


def test_a_prompt_longer_than_the_routed_blocks_follows_its_shared_prefix():
    """Only the first max_blocks blocks are hashed: a match of all of them counts as the whole
    routed prompt, however long the rest (long system prompts, retrieved documents)."""
    config = RouterConfig(block_size=BS, max_blocks=8)
    router = PrefixAwareRouter(2, config)
    shared = list(range(20 * BS))  # 20 blocks shared, 8 of them routed
    homes = [router.route(shared + [10 ** 6 + 100 * user + k for k in range(30 * BS)], 10) for user in range(6)]
    assert len(set(homes)) == 1


def test_a_dead_replica_gets_nothing_and_forgets_its_prefixes():
    router = PrefixAwareRouter(2, RouterConfig(block_size=BS))
    cached = router.route(prompt(0, 0), 10)
    router.mark_dead(cached)
    assert router.live_replicas == [1 - cached]
    assert all(router.route(prompt(s, u), 10) == 1 - cached for s in range(3) for u in range(3))
    router.mark_dead(1 - cached)
    with pytest.raises(RuntimeError, match="no live replica"):
        router.choose(prompt(0, 0))


def test_round_robin_takes_live_replicas_in_turn_blind_to_prefixes():
    router = RoundRobinRouter(3, RouterConfig(block_size=BS))
    assert [router.route(prompt(0, u), 1) for u in range(4)] == [0, 1, 2, 0]
    router.mark_dead(1)
    assert [router.route(prompt(0, u), 1) for u in range(4)] == [2, 0, 2, 0]


def test_the_load_balance_option_names_a_router_and_defaults_to_prefix_aware():
    assert tuple(ROUTERS) == LOAD_BALANCE_METHODS  # every choice the server offers has its router
    assert ServerConfig().load_balance_method == "prefix_aware"
    assert type(make_router(ServerConfig().load_balance_method, 2, RouterConfig(block_size=BS))) is PrefixAwareRouter
    assert type(make_router("round_robin", 2, RouterConfig(block_size=BS))) is RoundRobinRouter
    from compiled_llm.cli.main import make_parser
    from compiled_llm.cli.serve import server_config

    flags = make_parser().parse_args(["serve", "ENGINE", "--load-balance-method", "round_robin"])
    assert server_config(flags).load_balance_method == "round_robin"
    with pytest.raises(InvalidOptionError) as e:
        ServerConfig(load_balance_method="cache_aware")
    assert str(e.value) == "unknown load_balance_method 'cache_aware'; choose one of: prefix_aware, round_robin"


def test_a_router_config_refuses_nonsense():
    with pytest.raises(ValueError, match="block_size"):
        RouterConfig(block_size=0)
    with pytest.raises(ValueError, match="cache_threshold"):
        RouterConfig(block_size=BS, cache_threshold=1.5)


# ---- placement --------------------------------------------------------------------------------------------


def test_each_replica_owns_its_tensor_parallel_group_of_gpus():
    assert replica_gpus(2, 2, visible_gpus(None, 4)) == ["0,1", "2,3"]
    assert replica_gpus(3, 1, visible_gpus("4, 5,6,7", 4)) == ["4", "5", "6"]  # numbered as CUDA_VISIBLE_DEVICES does


def test_more_replicas_than_gpus_is_one_line_naming_the_numbers():
    with pytest.raises(InvalidOptionError) as e:
        replica_gpus(2, 4, visible_gpus(None, 4))
    assert str(e.value) == ("data_parallel_size 2 x 4 GPUs a replica (tensor x pipeline parallel) needs 8 GPUs, "
                            "but 4 are visible")


def test_replicas_cannot_share_one_named_gpu():
    check_replica_device("cuda", 2)
    check_replica_device("cuda:1", 1)
    with pytest.raises(InvalidOptionError, match="cuda:1 names one GPU"):
        check_replica_device("cuda:1", 2)


def test_cpu_replicas_split_the_cores_between_them():
    assert [replica_cpu_threads(2, cpus) for cpus in (1, 2, 3, 16)] == [1, 1, 1, 8]
    assert replica_cpu_threads(1, 16) == 16
