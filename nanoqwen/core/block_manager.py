"""Which KV-cache blocks each sequence owns, with prefix caching.

The cache is a pool of `num_blocks` blocks of `block_size` token positions. A sequence's
`block_table` lists its blocks in order: token i lives in block_table[i // block_size] at offset
i % block_size.

Prefix caching: once a block is full, it is keyed by a hash of every token up to its end (the
hash of the previous block and its own tokens), so a new request whose prompt starts with the
same tokens reuses it instead of recomputing it. Blocks are shared by reference count. A freed
block keeps its key and stays reusable until the pool needs it back.

New tokens get a free block that caches nothing, most recently freed first (its memory is warm,
and on CPU the pool's untouched pages never take RAM); only when there is none is a cached
block evicted, least recently freed first, so the most recently used prefixes survive longest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from nanoqwen.core.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered for reuse
    token_ids: tuple[int, ...] = ()  # its tokens, to confirm a hash hit is a real match


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # a stack: block 0 is handed out first
        self.free_uncached = list(range(num_blocks - 1, -1, -1))
        # free blocks still caching a prefix, oldest first
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.cached_blocks: dict[int, int] = {}  # hash -> block id
        self.prefix_queries = self.prefix_hits = 0  # in blocks, for the hit rate
        self.peak_used_blocks = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.evictable)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that seq's block table covers its first num_tokens tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of seq's tokens; never the block of the last token,
        which must be computed to get the logits to sample from."""
        if not self.enable_prefix_caching:
            return []
        found = []
        num_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(seq, num_blocks)
        for i in range(num_blocks):
            block_id = self.cached_blocks.get(hashes[i])
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(seq, i):
                break
            found.append(block_id)
        return found

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chained hashes of (at least) seq's first num_blocks full blocks, computed once per
        sequence (its tokens never change); the sequence's own list, not a copy."""
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            # a LoRA adapter's KV differs from the base model's: its first block's key starts from the adapter
            previous = hashes[-1] if hashes else (("lora", seq.lora_id) if seq.lora_id else None)
            hashes.append(hash((previous, self._block_tokens(seq, len(hashes)))))
        return hashes

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids(i * self.block_size, (i + 1) * self.block_size))

    def allocate(self, seq: Sequence, cached: list[int], num_tokens: int) -> bool:
        """Give a waiting seq the cached prefix blocks plus new blocks up to num_tokens; False if
        the pool is too small right now (nothing is changed then)."""
        # free but cached: taken, not new
        reclaimed = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        new = max(0, -(-num_tokens // self.block_size) - len(cached))
        if new > self.num_free_blocks - reclaimed:
            return False
        for block_id in cached:
            self._ref(block_id)
        seq.block_table = list(cached)
        seq.num_registered_blocks = len(cached)
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_size
        self.prefix_queries += max(0, (seq.num_tokens - 1) // self.block_size)
        self.prefix_hits += len(cached)
        return self.append_slots(seq, num_tokens)

    def append_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to cover num_tokens tokens; False (and no change) if
        blocks run out."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free())
        return True

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past seq's tokens (those that held rejected draft tokens); they
        never joined the prefix cache (only computed tokens' blocks do)."""
        keep = -(-seq.num_tokens // self.block_size)
        tail, seq.block_table = seq.block_table[keep:], seq.block_table[:keep]
        self._release(tail)

    def register_full_blocks(self, seq: Sequence) -> None:
        """Key the blocks that this step filled, so later requests can reuse them (only blocks
        whose tokens seq holds: a sequence that finished inside a multi-step window, at a stop
        string or at a stop token while other rows ran on, has computed more)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if num_full <= seq.num_registered_blocks:  # most decode steps: no block filled up
            return
        hashes = self._block_hashes(seq, num_full)
        # only the newly filled ones: no rescan per step
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.cached_blocks:
                block.hash, block.token_ids = hashes[i], self._block_tokens(seq, i)
                self.cached_blocks[hashes[i]] = block.block_id
        seq.num_registered_blocks = num_full

    def fork(self, parent: Sequence, child: Sequence,
             copy_block: Callable[[int, int], None]) -> bool:
        """Let child continue from parent's cache: full blocks are shared, a partly filled last
        block is copied (both will write into it). False if no block is free for the copy."""
        partial = parent.num_computed_tokens % self.block_size
        if partial and not self.num_free_blocks:
            return False
        shared = parent.block_table[: parent.num_computed_tokens // self.block_size]
        for block_id in shared:
            self._ref(block_id)
        child.block_table = list(shared)
        child.num_registered_blocks = len(shared)
        if partial:
            new = self._take_free()
            copy_block(parent.block_table[len(shared)], new)
            child.block_table.append(new)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        return True

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; its blocks become free (still reusable by hash)
        once nobody holds them."""
        self._release(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def _release(self, block_ids: list[int]) -> None:
        # Tail first: evictable blocks go oldest first, so a sequence's prefix outlives its tail.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self.free_uncached.append(block_id)
                else:
                    self.evictable[block_id] = None

    def _ref(self, block_id: int) -> int:
        """One more holder of a block (a prefix-cache hit keeps the block's key)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            # a free block reached by its hash is always an evictable one
            del self.evictable[block_id]
        block.ref_count += 1
        return block_id

    def _take_free(self) -> int:
        """A free block for new tokens: an uncached one, else the oldest cached one,
        whose prefix is forgotten."""
        if self.free_uncached:
            block_id = self.free_uncached.pop()
        else:
            block_id, _ = self.evictable.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.cached_blocks[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_blocks - self.num_free_blocks)
        return block_id
