"""Speculative decoding's options (`speculative_config`, vLLM's names): which proposer, how many draft
tokens, when to stop speculating."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from nanoqwen.config.quantization import QUANTIZATION_METHODS
from nanoqwen.errors import ConfigError

SPECULATIVE_METHODS = ("ngram", "draft_model", "self_quantized")
# speculation is off in steps with more running sequences than this, unless the config says
# otherwise: on a 2-core CPU, drafts that are all accepted still pay at batch 2 and no longer at
# batch 4 (bench/bench_spec.py measures it)
DEFAULT_SPEC_MAX_BATCH = 2


@dataclass
class SpeculativeConfig:
    """Speculative decoding (nanoqwen/spec_decode/proposer.py proposes, nanoqwen/sample/rejection_sampler.py
    verifies), with vLLM's `speculative_config` names:

    - {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
      "prompt_lookup_min": m}: the k tokens that followed the latest earlier occurrence of the
      answer's last n..m tokens (in the prompt or the answer);
    - {"method": "draft_model", "model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": k}: a
      smaller model with the same tokenizer proposes k tokens ("model" alone implies this method);
    - {"method": "self_quantized", "quantization": "int4", "num_speculative_tokens": k}: the
      target's own weights quantised at load (nanoqwen/quantization/) are the draft.

    disable_by_batch_size: no speculation in a step with more running sequences than this (then a
    step is no longer bound by reading the weights, and verifying k tokens per sequence costs
    more than it saves); None: DEFAULT_SPEC_MAX_BATCH.
    disable_by_acceptance: pause a sequence's speculation while its drafts are accepted too seldom
    to pay for their cost, measured as it runs (nanoqwen/spec_decode/spec_switch.py).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    quantization: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    disable_by_acceptance: bool = True

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a dict, a JSON object text (--speculative-config) or one
        already made; None stays None."""
        if value is None or isinstance(value, cls):
            return value
        where = "speculative_config"
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where} is not valid JSON ({e}); give an object such as "
                                  '{"method": "ngram", "num_speculative_tokens": 4}') from None
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be an object, found {type(value).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = [k for k in value if k not in known]
        if unknown:
            raise ConfigError(f"{where}: unknown field {unknown[0]!r}; the fields are: "
                              f"{', '.join(known)}")
        raw = dict(value)
        if raw.get("method") is None:
            if raw.get("model") is None:
                raise ConfigError(f"{where}: field 'method' is missing; choose one of "
                                  f"{', '.join(SPECULATIVE_METHODS)}")
            # vLLM's older spelling {"model": "[ngram]"}; any other model is a draft model
            ngram = raw["model"] in ("ngram", "[ngram]")
            raw["method"] = "ngram" if ngram else "draft_model"
            raw["model"] = None if ngram else raw["model"]
        if "num_speculative_tokens" not in raw:
            raise ConfigError(f"{where}: field 'num_speculative_tokens' is missing (the tokens "
                              "proposed per step, e.g. 4)")
        return cls(**raw)

    def __post_init__(self) -> None:
        where = "speculative_config"
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"{where}: method={self.method!r} is not one of "
                              f"{', '.join(SPECULATIVE_METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{where}: {name}={v!r} must be an integer >= 1")
        if not isinstance(self.disable_by_acceptance, bool):
            raise ConfigError(f"{where}: disable_by_acceptance={self.disable_by_acceptance!r} "
                              "must be true or false")
        if self.method == "ngram":
            # vLLM's defaults: both 5 when neither is given, else the one given for both
            self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min or 5
            self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ConfigError(f"{where}: prompt_lookup_min={self.prompt_lookup_min} is more "
                                  f"than prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError(f"{where}: method 'draft_model' needs 'model', the draft's folder "
                              "or hub id (e.g. Qwen/Qwen3-0.6B)")
        if self.method == "self_quantized":
            if self.quantization is None:
                self.quantization = "int4"
            if self.quantization not in QUANTIZATION_METHODS:
                raise ConfigError(f"{where}: quantization={self.quantization!r} is not one of "
                                  f"{', '.join(QUANTIZATION_METHODS)}")
        elif self.quantization is not None and self.method == "ngram":
            raise ConfigError(f"{where}: 'quantization' is for method 'self_quantized' (or a "
                              "draft model's weights), not 'ngram'")


