"""Decode steps replayed from captured CUDA graphs, one graph per batch size
in a fixed set of buckets.

A decode step of b sequences launches hundreds of small kernels (batch 1 spends more time launching
them than running them). CUDAGraphRunner records the whole decode forward, model and LM head, once
per bucket size B (1, 2, 4, 8, 16, 24, 32, then every 16th up to max_num_seqs), reading its inputs
from static buffers. A step of b sequences is padded to the smallest bucket B >= b: rows b..B-1 get
token 0 at position 0, write their keys and values to a scratch slot no sequence owns, and attend to
nothing (context_len 0, so the paged kernel writes zeros). The graph is replayed and the first b
rows of its logits are returned. The logits live in the graphs' shared memory pool, so they are only
valid until the next replay: the caller samples from them at once.

Graphs need attention whose shapes do not depend on the data: the paged decode kernels of
nanoqwen/attention/backends/paged.py over block tables of a fixed width (enough
blocks for max_model_len).

With use_graphs=False (CPU, tests) nothing is captured and run() executes the same
padded static-buffer forward eagerly, so the padding and slicing bookkeeping is
exercised and checked on any machine.
"""

from __future__ import annotations

import bisect

import torch

from nanoqwen.attention.kv_cache import KVCache
from nanoqwen.attention.metadata import AttentionMetadata, DecodeRow, PagedDecode
from nanoqwen.models.qwen3 import Qwen3ForCausalLM

MAX_GRAPH_BATCH = 512  # larger decode batches run eagerly (graph memory grows with the bucket)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, 16, 24, 32, 48, 64, 80, ... (every 16th), capped by and
    including max_num_seqs."""
    cap = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [1, 2, 4, 8, 16, 24, 32, *range(48, MAX_GRAPH_BATCH + 1, 16)]
    return sorted({s for s in sizes if s < cap} | {cap})


def bucket_for(batch_sizes: list[int], b: int) -> int | None:
    """The smallest bucket holding b rows, or None when b is larger than every bucket."""
    i = bisect.bisect_left(batch_sizes, b)
    return batch_sizes[i] if i < len(batch_sizes) else None


class CUDAGraphRunner:
    def __init__(self, model: Qwen3ForCausalLM, kv_cache: KVCache, scratch_slot: int,
                 max_num_seqs: int, max_blocks_per_seq: int, backend: str,
                 use_graphs: bool = True) -> None:
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.scratch_slot = scratch_slot  # a slot of a block the block manager never hands out
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.use_graphs = use_graphs
        device, n = kv_cache.k.device, self.batch_sizes[-1]
        # Static inputs, [max bucket] rows; a bucket of B rows reads their first B rows.
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)  # [B]
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # [B]
        self.slot_mapping = torch.full((n,), scratch_slot, dtype=torch.long, device=device)  # [B]
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)  # [B, W]
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)  # [B]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> its graph's logits [B, V]

    def metadata(self, size: int) -> AttentionMetadata:
        """Attention metadata over the first `size` rows of the static buffers (views:
        replays see new contents)."""
        paged = PagedDecode(self.block_tables[:size], self.context_lens[:size], self.backend)
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size],
                                 positions=self.positions[:size],
                                 block_size=self.kv_cache.block_size, num_decode_tokens=size,
                                 paged_decode=paged)

    def forward(self, size: int) -> torch.Tensor:
        """The decode forward of one bucket on the static buffers: float32 logits [size, V]."""
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache,
                            self.metadata(size))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, the largest first, all sharing one memory pool.

        Call after the KV cache is allocated. Every buffer holds padding (scratch slot,
        context_len 0) during capture, so the warm-up runs write only the scratch slot and read
        nothing.
        """
        if not self.use_graphs:
            return
        pool = None
        for size in reversed(self.batch_sizes):
            # warm-up outside the graph: Triton compiles, cuBLAS picks its kernels
            self.forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, decode: list[DecodeRow]) -> bool:
        bs = self.kv_cache.block_size
        return (bucket_for(self.batch_sizes, len(decode)) is not None
                and all(-(-row.context_len // bs) <= self.max_blocks_per_seq for row in decode))

    @torch.inference_mode()
    def run(self, input_ids: list[int], decode: list[DecodeRow]) -> torch.Tensor:
        """One decode step: input_ids [b] and a DecodeRow each -> float32 logits [b, V]."""
        b = len(decode)
        size = bucket_for(self.batch_sizes, b)
        meta = AttentionMetadata.build(decode, [], self.kv_cache.block_size, torch.device("cpu"),
                                       paged_backend=self.backend)
        p = meta.paged_decode

        # [b] -> [size]: padding rows get fill
        def padded(values: torch.Tensor, fill: int) -> torch.Tensor:
            return torch.cat([values, values.new_full((size - b,), fill)])

        self.input_ids[:size].copy_(padded(torch.tensor(input_ids), 0))
        self.positions[:size].copy_(padded(meta.positions, 0))
        self.slot_mapping[:size].copy_(padded(meta.slot_mapping, self.scratch_slot))
        self.context_lens[:size].copy_(padded(p.context_lens, 0))
        # Columns past this step's widest table, and padding rows, keep stale block ids:
        # never read (context_len).
        self.block_tables[:b, : p.block_tables.shape[1]].copy_(p.block_tables)
        if self.use_graphs:
            self.graphs[size].replay()
            logits = self.outputs[size]
        else:
            logits = self.forward(size)
        return logits[:b]
