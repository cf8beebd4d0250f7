"""PoolingParams: how one embedding or scoring request reads the model's last hidden state (vLLM's
names)."""

from __future__ import annotations

from dataclasses import dataclass

from nanoqwen.errors import InvalidRequestError


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class PoolingParams:
    """dimensions: keep the first d values of the embedding (then normalise), as the Matryoshka-
    trained Qwen3-Embedding models allow; None keeps all. normalize: L2-normalise the embedding (what
    the models are trained for). truncate_prompt_tokens: keep only the last k tokens of a longer
    input instead of rejecting it (vLLM's rule); None rejects inputs over the context."""

    dimensions: int | None = None
    normalize: bool = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise InvalidRequestError(f"PoolingParams.dimensions={self.dimensions!r} is invalid: "
                                      "must be an integer >= 1 (or None for all)")
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"PoolingParams.normalize={self.normalize!r} is invalid: "
                                      "must be True or False")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or k < 1):
            raise InvalidRequestError(f"PoolingParams.truncate_prompt_tokens={k!r} is invalid: "
                                      "must be an integer >= 1 (or None to reject long inputs)")
