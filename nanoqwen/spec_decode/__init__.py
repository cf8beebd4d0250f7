"""Speculative decoding: proposers that draft tokens before a step (n-gram lookup, a draft model), and the
switch that pauses a sequence's drafts while they do not pay. The drafts are verified by
nanoqwen/sample/rejection_sampler.py."""
