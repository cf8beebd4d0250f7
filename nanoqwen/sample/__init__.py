"""From logits to tokens: the sampler (penalties, filters, seeded sampling, logprobs), the rejection
sampler that verifies speculative drafts, and structured outputs (grammars as token bitmasks)."""
