"""BlockManager on its own: block tables, reference counts, prefix caching, fork, eviction order.

Pure Python, no model: sequences are built by hand and the engine's part (tokens computed, full
blocks offered to the prefix cache) is done by `compute`.
"""

from __future__ import annotations

import pytest

from nanoqwen.core import block_manager as block_manager_module
from nanoqwen.core.block_manager import BlockManager
from nanoqwen.core.sequence import Sequence
from nanoqwen.sampling_params import SamplingParams

BS = 4  # block size of every manager here


def make_seq(tokens: list[int], request_id: str = "r", index: int = 0) -> Sequence:
    return Sequence(request_id, index, list(tokens), SamplingParams())


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """What a step does for seq: its first num_tokens (default: all) are in the cache, its full
    blocks are offered to the prefix cache."""
    seq.num_computed_tokens = seq.num_tokens if num_tokens is None else num_tokens
    bm.register_full_blocks(seq)


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit seq as the scheduler does (cached prefix first), compute all its tokens; the hits."""
    cached = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, cached, seq.num_tokens)
    compute(bm, seq)
    return cached


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def test_allocate_append_slots_and_free_keep_the_free_count():
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert (bm.num_blocks, bm.num_free_blocks) == (8, 8)
    seq = make_seq(range(10))
    assert bm.blocks_needed(seq, 10) == 3
    assert bm.allocate(seq, [], 10)
    assert seq.block_table == [0, 1, 2]  # block 0 first, consecutive blocks for a fresh pool
    assert bm.num_free_blocks == 5 and (seq.num_computed_tokens, seq.num_cached_tokens) == (0, 0)
    assert ref_counts(bm) == [1, 1, 1, 0, 0, 0, 0, 0]

    assert bm.blocks_needed(seq, 12) == 0 and bm.append_slots(seq, 12)  # the third block has room
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.blocks_needed(seq, 13) == 1 and bm.append_slots(seq, 13)
    assert seq.block_table == [0, 1, 2, 3] and bm.num_free_blocks == 4

    other = make_seq(range(100, 105))
    assert bm.allocate(other, [], 5) and len(set(other.block_table) | set(seq.block_table)) == 6
    assert bm.num_free_blocks == 2

    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 6
    bm.free(other)
    assert bm.num_free_blocks == 8 and ref_counts(bm) == [0] * 8


def test_running_out_of_blocks_fails_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(range(12))
    assert bm.allocate(a, [], 12) and bm.num_free_blocks == 1
    b = make_seq(range(100, 108))
    assert not bm.allocate(b, [], 8)  # 2 blocks wanted, 1 free
    assert b.block_table == [] and bm.num_free_blocks == 1 and ref_counts(bm) == [1, 1, 1, 0]
    assert not bm.append_slots(a, 17)  # 2 more blocks wanted, 1 free
    assert a.block_table == [0, 1, 2] and bm.num_free_blocks == 1
    assert bm.append_slots(a, 16) and bm.num_free_blocks == 0  # exactly the last one
    assert not bm.append_slots(a, 17) and len(a.block_table) == 4
    bm.free(a)
    assert bm.allocate(b, [], 8) and bm.num_free_blocks == 2


def test_allocate_counts_free_cached_prefix_blocks_as_taken_not_as_room():
    """Free (evictable) blocks of the cached prefix are reclaimed, so they are no room for new
    tokens: allocate must refuse up front, leaving no reference behind."""
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(range(9))  # 2 full blocks (cached) and a partial one
    admit(bm, a)
    bm.free(a)
    filler = make_seq(range(100, 108))
    assert bm.allocate(filler, [], 8)  # the 2 uncached blocks: only a's 2 cached ones are free
    assert bm.num_free_blocks == 2
    b = make_seq(list(range(8)) + [50, 51, 52, 53, 54])  # 13 tokens: a's 2 blocks + 2 new ones
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2
    assert not bm.allocate(b, cached, 13)
    assert b.block_table == [] and bm.num_free_blocks == 2
    assert [bm.blocks[i].ref_count for i in cached] == [0, 0]
    # a's 2 and filler's 1: a refused admission counts nothing
    assert (bm.prefix_queries, bm.prefix_hits) == (3, 0)
    assert bm.find_cached_prefix(b) == cached  # still cached
    bm.free(filler)
    assert bm.allocate(b, cached, 13) and b.block_table[:2] == cached


def test_prefix_hit_shares_the_full_blocks_by_reference_count():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))
    assert admit(bm, a) == []
    b = make_seq(list(range(8)) + [99, 98, 97])
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_table[:2]
    assert bm.allocate(b, cached, b.num_tokens)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert (b.num_computed_tokens, b.num_cached_tokens) == (8, 8)
    assert [bm.blocks[i].ref_count for i in cached] == [2, 2]
    assert bm.num_free_blocks == 8 - 4  # a's 3 blocks and b's own third one


def test_a_shared_block_is_freed_only_when_both_holders_free_it():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))
    admit(bm, a)
    b = make_seq(list(range(8)) + [99, 98, 97])
    shared = admit(bm, b)
    assert len(shared) == 2
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    assert bm.num_free_blocks == 8 - 3  # only a's third block came back
    assert bm.allocate(make_seq(range(200, 220)), [], 20)  # 5 blocks: every free one, none of b's
    assert bm.num_free_blocks == 0 and b.block_table[:2] == shared
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    bm.free(b)
    assert [bm.blocks[i].ref_count for i in shared] == [0, 0] and bm.num_free_blocks == 3


def test_freed_blocks_stay_cached_until_the_pool_needs_them():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))
    admit(bm, a)
    prefix = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 8
    c = make_seq(list(range(8)) + [7, 7])
    assert bm.find_cached_prefix(c) == prefix
    assert admit(bm, c) == prefix and [bm.blocks[i].ref_count for i in prefix] == [1, 1]


def test_a_partly_filled_block_is_never_shared():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(7))  # one full block, 3 tokens in the second
    admit(bm, a)
    b = make_seq(list(range(7)) + [1, 2, 3, 4, 5])  # a's 7 tokens, then more
    assert bm.find_cached_prefix(b) == a.block_table[:1]
    # Filled later (by decoding), the block is shared from then on.
    a.output_token_ids.append(7)
    compute(bm, a)
    assert bm.find_cached_prefix(make_seq(list(range(8)) + [9])) == a.block_table[:2]


def test_the_block_of_the_last_token_is_never_taken_from_the_cache():
    """Its logits are needed to sample the next token, so at least that block is computed."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(12))
    admit(bm, a)
    # the same 12 tokens, 3 full blocks: 2 hit
    assert bm.find_cached_prefix(make_seq(range(12))) == a.block_table[:2]
    assert bm.find_cached_prefix(make_seq(range(9))) == a.block_table[:2]
    assert bm.find_cached_prefix(make_seq(range(8))) == a.block_table[:1]
    assert bm.find_cached_prefix(make_seq(range(4))) == []


def test_a_different_prefix_does_not_hit():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))
    admit(bm, a)
    assert bm.find_cached_prefix(make_seq([50] + list(range(1, 10)))) == []
    assert bm.find_cached_prefix(make_seq([0, 1, 2, 3, 4, 5, 6, 50, 8, 9])) == a.block_table[:1]
    assert bm.find_cached_prefix(make_seq(range(1, 11))) == []  # shifted by one token


def test_a_block_is_keyed_by_its_whole_prefix_not_only_its_own_tokens():
    """b's second block has a's second block's tokens after a different first block: a sequence
    continuing b must get b's blocks (a's second block holds keys computed after a's first)."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    b = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(bm, b) == []
    assert bm.find_cached_prefix(make_seq([0, 2, 3, 4, 5, 6, 7, 8, 10])) == b.block_table[:2]
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 10])) == a.block_table[:2]


def test_a_hash_collision_is_not_a_hit(monkeypatch):
    """Every block hashes alike here: only the stored tokens tell the blocks apart."""
    monkeypatch.setattr(block_manager_module, "hash", lambda _: 0, raising=False)
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(9))
    admit(bm, a)
    assert bm.find_cached_prefix(make_seq(list(range(4)) + [9, 9, 9, 9, 9])) == a.block_table[:1]
    assert bm.find_cached_prefix(make_seq([9, 9, 9, 9, 9])) == []


def test_the_same_prefix_computed_twice_is_cached_once():
    """Two sequences admitted together compute the same blocks; the first one registered stays the
    cached one, and evicting both later leaves the pool consistent."""
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b = make_seq(range(9)), make_seq(range(9))
    assert bm.allocate(a, [], 9) and bm.allocate(b, [], 9)
    compute(bm, a)
    compute(bm, b)
    assert bm.find_cached_prefix(make_seq(range(10))) == a.block_table[:2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 6
    big = make_seq(range(100, 124))  # every block: both copies evicted
    assert bm.allocate(big, [], 24) and bm.num_free_blocks == 0
    bm.free(big)
    assert bm.num_free_blocks == 6 and bm.find_cached_prefix(make_seq(range(10))) == []


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_seq(range(10))
    assert admit(bm, a) == []
    assert bm.find_cached_prefix(make_seq(range(10))) == []
    bm.free(a)
    assert bm.find_cached_prefix(make_seq(range(10))) == []
    b = make_seq(range(10))
    assert admit(bm, b) == [] and b.num_cached_tokens == 0
    assert bm.prefix_hits == 0 and bm.prefix_queries == 4


def test_hit_statistics_count_blocks():
    """prefix_queries: the blocks each admission could have found cached; prefix_hits: those
    it did."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    admit(bm, make_seq(range(10)))  # 2 blocks could hit, none do
    assert (bm.prefix_queries, bm.prefix_hits) == (2, 0)
    admit(bm, make_seq(list(range(8)) + [99, 98, 97]))  # 2 could, 2 do
    assert (bm.prefix_queries, bm.prefix_hits) == (4, 2)
    admit(bm, make_seq(list(range(4)) + [1] * 9))  # 3 could, 1 does
    assert (bm.prefix_queries, bm.prefix_hits) == (7, 3)
    admit(bm, make_seq([5, 6, 7]))  # 3 tokens: no block could
    assert (bm.prefix_queries, bm.prefix_hits) == (7, 3)


def test_fork_shares_full_blocks_and_copies_the_partly_filled_one():
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = make_seq(range(10), index=0)
    admit(bm, parent)
    child = make_seq(range(10), index=1)
    copies = []
    assert bm.fork(parent, child, lambda src, dst: copies.append((src, dst)))
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] not in parent.block_table
    assert copies == [(parent.block_table[2], child.block_table[2])]
    assert [bm.blocks[i].ref_count for i in parent.block_table] == [2, 2, 1]
    assert (child.num_computed_tokens, child.num_cached_tokens) == (10, parent.num_cached_tokens)
    assert bm.num_free_blocks == 8 - 4
    bm.free(parent)
    assert [bm.blocks[i].ref_count for i in child.block_table] == [1, 1, 1]
    assert bm.num_free_blocks == 5
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_fork_of_a_block_aligned_parent_copies_nothing_and_needs_no_free_block():
    bm = BlockManager(num_blocks=2, block_size=BS)
    parent = make_seq(range(8))
    admit(bm, parent)
    assert bm.num_free_blocks == 0
    child = make_seq(range(8), index=1)
    copies = []
    assert bm.fork(parent, child, lambda src, dst: copies.append((src, dst)))
    assert copies == [] and child.block_table == parent.block_table and ref_counts(bm) == [2, 2]


def test_fork_fails_when_no_block_is_free_for_the_copy():
    bm = BlockManager(num_blocks=3, block_size=BS)
    parent = make_seq(range(10))
    admit(bm, parent)
    assert bm.num_free_blocks == 0
    child = make_seq(range(10), index=1)
    copies = []
    assert not bm.fork(parent, child, lambda src, dst: copies.append((src, dst)))
    assert copies == [] and child.block_table == [] and child.num_computed_tokens == 0
    assert ref_counts(bm) == [1, 1, 1]


def test_peak_used_blocks_is_the_high_water_mark():
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert bm.peak_used_blocks == 0
    a, b = make_seq(range(12)), make_seq(range(100, 108))
    assert bm.allocate(a, [], 12)
    assert bm.peak_used_blocks == 3
    assert bm.allocate(b, [], 8)
    assert bm.peak_used_blocks == 5
    bm.free(a)
    bm.free(b)
    assert bm.peak_used_blocks == 5 and bm.num_free_blocks == 8
    assert bm.allocate(make_seq([1]), [], 1) and bm.peak_used_blocks == 5


def test_new_tokens_take_uncached_blocks_before_evicting_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(range(8))
    admit(bm, a)  # blocks 0 and 1: block 0 cached, block 1 (the last token's) cached too
    cached = list(a.block_table)
    bm.free(a)
    other = make_seq(range(100, 108))
    assert bm.allocate(other, [], 8)
    assert not set(other.block_table) & set(cached)
    assert bm.find_cached_prefix(make_seq(range(9))) == cached


def test_eviction_takes_a_sequence_tail_before_its_prefix():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_seq(range(8))
    admit(bm, a)
    head, tail = a.block_table
    bm.free(a)
    # One uncached block and a's two cached ones are free; 2 new blocks evict one of a's: the tail.
    new = make_seq(range(100, 108))
    assert bm.allocate(new, [], 8)
    assert tail in new.block_table and head not in new.block_table
    assert bm.find_cached_prefix(make_seq(range(9))) == [head]


def test_eviction_takes_the_least_recently_freed_prefix_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a, b = make_seq(range(4)), make_seq(range(50, 54))
    admit(bm, a)
    admit(bm, b)
    a_block, b_block = a.block_table[0], b.block_table[0]
    bm.free(b)
    bm.free(a)  # a freed last: its prefix is the one kept
    assert bm.allocate(make_seq(range(100, 112)), [], 12)  # 2 uncached blocks, then one eviction
    assert bm.find_cached_prefix(make_seq(range(5))) == [a_block]
    assert bm.find_cached_prefix(make_seq(range(50, 55))) == []
    assert b_block != a_block


@pytest.mark.parametrize("computed", [3, 8, 11])
def test_register_full_blocks_keys_only_full_computed_blocks(computed):
    """A chunked prefill registers the blocks a chunk filled, never ones not yet computed."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(12))
    assert bm.allocate(a, [], 12)
    compute(bm, a, computed)
    hits = bm.find_cached_prefix(make_seq(range(13)))
    assert hits == a.block_table[: computed // BS]
    assert a.num_registered_blocks == computed // BS
