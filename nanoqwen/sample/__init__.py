"""From logits to tokens: the sampler (filters, seeded sampling, logprobs), the logit adjustments before
it (penalties.py: min_tokens, the penalties), the rejection sampler that verifies speculative drafts, and
structured outputs (grammars as token bitmasks)."""
