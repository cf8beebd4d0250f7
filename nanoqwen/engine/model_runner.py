"""Run one scheduled step on the model: pack the tokens, run the forward, sample the next tokens."""

from __future__ import annotations

import torch

from nanoqwen.engine.kv_cache import AttentionMetadata, KVCache
from nanoqwen.engine.scheduler import ScheduledBatch
from nanoqwen.engine.sequence import Sequence
from nanoqwen.models.qwen3 import Qwen3ForCausalLM
from nanoqwen.sampler import sample


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, max_num_seqs: int, max_model_len: int) -> None:
        self.model = model
        self.device = model.embed_tokens.device
        c = model.config
        self.kv_cache = KVCache(c.num_hidden_layers, max_num_seqs, max_model_len, c.num_key_value_heads,
                                c.head_dim, model.embed_tokens.dtype, self.device)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
        """Run the step; return (sequence, new token) for every sequence that reached its next token.

        A prompt chunk that does not finish its prompt produces no token: only its K/V are cached.
        """
        input_ids: list[int] = []
        decode = []
        for seq in batch.decode:
            input_ids.append(seq.token_ids(seq.num_tokens - 1, seq.num_tokens)[0])
            decode.append((seq.slot, seq.num_tokens))
        prefill = []
        sampled, sample_rows = list(batch.decode), list(range(len(batch.decode)))  # decode rows come first
        for seq, n in batch.prefill:
            start = seq.num_computed_tokens
            input_ids += seq.token_ids(start, start + n)
            prefill.append((seq.slot, start, n))
            if start + n == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        meta = AttentionMetadata.build(decode, prefill, self.device)
        hidden = self.model(torch.tensor(input_ids, device=self.device), meta.positions, self.kv_cache, meta)
        for seq in batch.decode:
            seq.num_computed_tokens += 1
        for seq, n in batch.prefill:
            seq.num_computed_tokens += n
        if not sampled:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        tokens = sample(logits, [s.sampling_params for s in sampled], [s.generator for s in sampled])
        return list(zip(sampled, tokens.tolist(), strict=True))
