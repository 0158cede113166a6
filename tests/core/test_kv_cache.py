"""KV block manager: exact block ids, free-queue order, prefix hits. Tiny block sizes."""

from __future__ import annotations

import pytest

from pagedllm.core import kv_cache
from pagedllm.core.kv_cache import (
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    hash_block_tokens,
)
from tests.core.helpers import check_pool_invariants, make_request


def manager(num_blocks: int = 10, block_size: int = 4, caching: bool = True,
            **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, caching, max_model_len=128, **kwargs)


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def compute(kv: KVCacheManager, request, num_tokens: int | None = None) -> list[int]:
    """Admit ``request`` with its prefix hits and compute ``num_tokens`` (default: all)."""
    hits, num_hit = kv.get_computed_blocks(request)
    todo = (request.num_tokens - num_hit) if num_tokens is None else num_tokens
    new_ids = kv.allocate_slots(request, todo, hits, num_hit)
    assert new_ids is not None
    request.num_computed_tokens = num_hit + todo
    return new_ids


# -- free queue -------------------------------------------------------------------------
def test_free_queue_pops_in_id_order_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.popleft().block_id == 0
    queue.append(blocks[0])
    queue.appendleft(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [2, 1, 3, 4, 0]
    assert [b.block_id for b in queue.popleft_n(3)] == [2, 1, 3]
    assert len(queue) == 2
    with pytest.raises(ValueError, match="free"):
        queue.popleft_n(3)
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])


# -- allocation -------------------------------------------------------------------------
def test_fresh_pool_hands_out_block_ids_in_order():
    kv = manager()
    a = make_request("a", 10)
    b = make_request("b", 5)
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    assert kv.allocate_slots(b, 5) == [3, 4]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(0.5)


def test_decode_takes_a_new_block_only_when_the_last_one_is_full():
    kv = manager()
    a = make_request("a", 4)
    compute(kv, a)
    assert kv.get_block_ids("a") == [0]
    a.append_output_token(7)
    assert kv.allocate_slots(a, 1) == [1]  # position 4 starts block 1
    a.num_computed_tokens += 1
    a.append_output_token(8)
    assert kv.allocate_slots(a, 1) == []
    assert kv.get_block_ids("a") == [0, 1]


def test_allocation_that_does_not_fit_returns_none_without_side_effects():
    kv = manager(num_blocks=3)
    a = make_request("a", 8)
    compute(kv, a)
    kv.free(a)  # blocks 0, 1 are free but cached
    b = make_request("b", a.prompt_token_ids + [1] * 8)  # 2 hits + needs 2 new = 4 > 3
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    before = free_ids(kv)
    assert kv.allocate_slots(b, 8, hits, num_hit) is None
    assert free_ids(kv) == before
    assert [blk.ref_cnt for blk in hits] == [0, 0]
    assert kv.get_block_ids("b") == []
    check_pool_invariants(kv)


def test_hit_blocks_that_are_free_count_against_the_free_pool():
    kv = manager(num_blocks=4)
    a = make_request("a", 8)
    compute(kv, a)
    kv.free(a)
    b = make_request("b", a.prompt_token_ids + [1] * 4)
    hits, num_hit = kv.get_computed_blocks(b)
    # 4 free blocks: 2 are b's hits, so 2 remain for new blocks; b needs 1.
    assert kv.allocate_slots(b, 4, hits, num_hit) == [2]
    assert kv.get_block_ids("b") == [0, 1, 2]
    assert kv.num_free_blocks == 1
    check_pool_invariants(kv)


def test_allocation_beyond_max_model_len_is_refused():
    kv = KVCacheManager(10, 4, True, max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len=8"):
        kv.allocate_slots(make_request("a", 9), 9)


# -- freeing and eviction order ---------------------------------------------------------
def test_freed_blocks_rejoin_the_queue_last_block_first():
    kv = manager()
    a = make_request("a", 12)  # three full blocks, all cached
    compute(kv, a)
    kv.free(a)
    assert free_ids(kv) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert kv.num_free_blocks == 10


def test_uncached_blocks_are_reused_before_any_cached_block_is_evicted():
    kv = manager()
    a = make_request("a", 10)  # blocks 0, 1 full (cached), block 2 partial
    compute(kv, a)
    kv.free(a)
    assert free_ids(kv) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    b = make_request("b", 32)
    assert kv.allocate_slots(b, 32) == [2, 3, 4, 5, 6, 7, 8, 9]
    hits, num_hit = kv.get_computed_blocks(make_request("a2", a.prompt_token_ids))
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8


def test_eviction_takes_the_end_of_a_chain_before_its_beginning():
    kv = manager(num_blocks=6)
    a = make_request("a", 12)
    compute(kv, a)  # blocks 0, 1, 2
    kv.free(a)
    kv.allocate_slots(make_request("b", 16), 16)  # 3, 4, 5 then evicts 2 (a's last block)
    hits, num_hit = kv.get_computed_blocks(make_request("a2", a.prompt_token_ids + [5]))
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8


def test_least_recently_freed_chain_is_evicted_first():
    kv = manager(num_blocks=4)
    a, b = make_request("a", 8), make_request("b", 8)
    compute(kv, a)  # 0, 1
    compute(kv, b)  # 2, 3
    kv.free(a)
    kv.free(b)
    assert free_ids(kv) == [1, 0, 3, 2]
    kv.allocate_slots(make_request("c", 8), 8)  # evicts all of a
    assert kv.get_computed_blocks(make_request("a2", a.prompt_token_ids + [1]))[1] == 0
    assert kv.get_computed_blocks(make_request("b2", b.prompt_token_ids + [1]))[1] == 8


def test_pool_is_full_again_after_every_request_is_freed():
    kv = manager(num_blocks=8)
    requests = [make_request(str(i), 3 + 2 * i) for i in range(4)]
    for r in requests:
        compute(kv, r)
    assert kv.usage > 0
    for r in requests:
        kv.free(r)
    assert kv.num_free_blocks == 8 and kv.usage == 0.0
    check_pool_invariants(kv)


# -- prefix cache -----------------------------------------------------------------------
def test_prefix_hit_is_counted_in_tokens():
    kv = manager()
    a = make_request("a", 10)
    compute(kv, a)
    before = (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits)
    b = make_request("b", a.prompt_token_ids[:8] + [1, 2, 3])
    hits, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    kv.get_computed_blocks(b)  # a lookup retried while waiting for room is not counted
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == before
    kv.allocate_slots(b, 3, hits, num_hit)  # admitted: counted once
    after = (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits)
    assert (after[0] - before[0], after[1] - before[1]) == (11, 8)
    assert kv.prefix_cache_stats.queries == 10 + 11


def test_hit_never_covers_the_last_prompt_token():
    kv = manager()
    a = make_request("a", 8)
    compute(kv, a)  # two full cached blocks
    same = make_request("same", a.prompt_token_ids)
    hits, num_hit = kv.get_computed_blocks(same)
    assert num_hit == 4  # block 1 holds the last token: it is recomputed
    assert kv.allocate_slots(same, 4, hits, num_hit) == [2]
    longer = make_request("longer", a.prompt_token_ids + [9])
    assert kv.get_computed_blocks(longer)[1] == 8


def test_shared_hit_blocks_are_reference_counted():
    kv = manager()
    a = make_request("a", 9)
    compute(kv, a)
    b = make_request("b", a.prompt_token_ids[:8] + [5, 6])
    compute(kv, b)
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2] == [0, 1]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.free(a)
    assert kv.num_free_blocks == 10 - 3  # a's shared blocks stay with b
    check_pool_invariants(kv)


def test_block_hash_names_the_whole_prefix():
    first = hash_block_tokens(None, (1, 2))
    other_first = hash_block_tokens(None, (9, 9))
    assert hash_block_tokens(first, (3, 4)) != hash_block_tokens(other_first, (3, 4))
    same_first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(first, (3, 4)) == hash_block_tokens(same_first, [3, 4])
    assert hash_block_tokens(None, (1, 2), ("salt",)) != first


def test_digest_collision_never_produces_a_false_hit(monkeypatch):
    monkeypatch.setattr(kv_cache, "block_digest", lambda *args: b"same digest")
    kv = manager()
    a = make_request("a", 5)
    compute(kv, a)
    b = make_request("b", 5)  # different tokens, equal digests
    assert kv.get_computed_blocks(b) == ([], 0)
    compute(kv, b)
    # Both blocks are cached side by side, and each prefix finds its own.
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    hits, _ = kv.get_computed_blocks(make_request("b2", b.prompt_token_ids))
    assert [blk.block_id for blk in hits] == kv.get_block_ids("b")[:1]
    hits, _ = kv.get_computed_blocks(make_request("a2", a.prompt_token_ids))
    assert [blk.block_id for blk in hits] == kv.get_block_ids("a")[:1]


def test_cache_salt_isolates_prefixes():
    kv = manager()
    a = make_request("a", 9, cache_salt="tenant-1")
    compute(kv, a)
    tokens = a.prompt_token_ids
    assert kv.get_computed_blocks(make_request("b", tokens, cache_salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", tokens))[1] == 0
    assert kv.get_computed_blocks(make_request("d", tokens, cache_salt="tenant-1"))[1] == 8


def test_prompt_logprobs_request_skips_hits_but_its_blocks_do_not_duplicate_the_cache():
    kv = manager()
    a = make_request("a", 9)
    compute(kv, a)
    b = make_request("b", a.prompt_token_ids, prompt_logprobs=1)
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.prefix_cache_stats.queries == 9  # b's skipped lookup is not counted
    compute(kv, b)
    assert kv.get_block_ids("b") == [3, 4, 5]
    assert len(kv.block_pool.cached_block_hash_to_block) == 2  # a's copy keeps serving hits


def test_caching_disabled_finds_no_hits_and_hashes_nothing():
    kv = manager(caching=False)
    a = make_request("a", 9)
    compute(kv, a)
    assert a.block_hashes == []
    assert kv.get_computed_blocks(make_request("b", a.prompt_token_ids + [1])) == ([], 0)


def test_only_known_tokens_are_cached_as_the_request_grows():
    kv = manager()
    a = make_request("a", 6)
    compute(kv, a, 3)  # a chunk of 3: no block full yet
    assert kv.block_pool.cached_block_hash_to_block == {}
    kv.allocate_slots(a, 3)
    a.num_computed_tokens = 6
    assert len(kv.block_pool.cached_block_hash_to_block) == 1
    for token in (1, 2):
        a.append_output_token(token)
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert len(kv.block_pool.cached_block_hash_to_block) == 2  # tokens 4..7 filled block 1
    assert len(a.block_hashes) == 2


def test_reset_prefix_cache_forgets_every_hit():
    kv = manager()
    a = make_request("a", 9)
    compute(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", a.prompt_token_ids))[1] == 0
    assert kv.num_free_blocks == 10
    check_pool_invariants(kv)


def test_watermark_keeps_headroom_when_admitting_but_not_for_running_or_lone_requests():
    kv = manager(num_blocks=10, watermark=0.2)  # 2 blocks of headroom
    assert kv.allocate_slots(make_request("big", 40), 40) is not None  # lone: whole pool
    kv.free(make_request("big", 1))
    a = make_request("a", 4)
    compute(kv, a)
    assert kv.allocate_slots(make_request("b", 32), 32) is None  # 8 + 2 > 9 free
    assert kv.allocate_slots(make_request("c", 28), 28) is not None  # 7 + 2 <= 9
    a.append_output_token(1)
    assert kv.allocate_slots(a, 1) == [1]  # a running request may use the headroom


@pytest.mark.parametrize("bad", [dict(block_size=0), dict(watermark=1.0), dict(num_blocks=0)])
def test_invalid_manager_arguments_name_the_parameter(bad):
    args = dict(num_blocks=4, block_size=4, watermark=0.0) | bad
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        KVCacheManager(args["num_blocks"], args["block_size"], True, 16,
                       watermark=args["watermark"])
