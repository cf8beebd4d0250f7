"""From what a caller gives (text, token ids, an embedding text, a query-document pair) to the validated
token ids of a request, and its parameters checked against the model's task: everything before a request
reaches the scheduler. vLLM's InputProcessor, in small.

Embedding and reranker inputs are written as their models expect: an embedding model's prompt and text
tokenised together with the tokenizer's special tokens (as sentence-transformers does), a reranker's query
and document in the Qwen3-Reranker model card's yes/no prompt.
"""

from __future__ import annotations

from nanoqwen.config.engine import EngineConfig
from nanoqwen.config.model import GenerationConfig, Qwen3Config
from nanoqwen.config.pooling import SentenceTransformersConfig
from nanoqwen.errors import InvalidRequestError
from nanoqwen.pooling_params import PoolingParams
from nanoqwen.sampling_params import SamplingParams
from nanoqwen.tokenizer import Tokenizer

# The Qwen3-Reranker model card's prompt: a system line, the instruction, query and document in the
# user turn, and the assistant turn opened with an empty think block.
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on "
                 "the Query and the Instruct provided. Note that the answer can only be \"yes\" or "
                 "\"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def rerank_prompt_ids(tokenizer: Tokenizer, query: str, document: str,
                      instruction: str | None = None) -> list[int]:
    """The reranker's input for one (query, document) pair, tokenised as the model card does:
    prefix, pair and suffix each on their own."""
    pair = (f"<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}")
    return (tokenizer.encode(RERANK_PREFIX) + tokenizer.encode(pair)
            + tokenizer.encode(RERANK_SUFFIX))


def embedding_input_ids(tokenizer: Tokenizer, text: str | list[int], prompt: str = "") -> list[int]:
    """An embedding model's input: the prompt and text tokenised together with the tokenizer's own
    special tokens (Qwen3-Embedding's appends an end-of-text token), as sentence-transformers does;
    token ids as given."""
    if isinstance(text, str):
        return tokenizer.encode(prompt + text, add_special_tokens=True)
    return list(text)




class InputProcessor:
    """Tokenises and checks one engine's requests: its tokenizer, vocabulary, context length and task."""

    def __init__(self, tokenizer: Tokenizer, model_config: Qwen3Config, engine_config: EngineConfig,
                 max_model_len: int, task: str, generation_config: GenerationConfig,
                 sentence_transformers: SentenceTransformersConfig) -> None:
        self.tokenizer, self.max_model_len, self.task = tokenizer, max_model_len, task
        self.vocab_size, self.hidden_size = model_config.vocab_size, model_config.hidden_size
        self.max_stop_sequences = engine_config.max_stop_sequences
        self.max_stop_token_ids = engine_config.max_stop_token_ids
        self.generation_config, self.sentence_transformers = generation_config, sentence_transformers

    def default_sampling_params(self) -> SamplingParams:
        """The checkpoint's recommended sampling (generation_config.json), as vLLM does."""
        g = self.generation_config
        temperature = (g.temperature if g.temperature is not None else 1.0) if g.do_sample else 0.0
        return SamplingParams(
            temperature=temperature,
            top_k=g.top_k or -1, top_p=g.top_p if g.top_p is not None else 1.0,
            min_p=g.min_p or 0.0)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """A string is tokenized as is (no chat template); a list is taken as token ids."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(token_ids)
        return token_ids

    def embedding_input(self, text: str | list[int], prompt_name: str | None = None,
                        prompt: str | None = None,
                        params: PoolingParams | None = None) -> list[int]:
        """An embedding model's input ids for a text (after its prompt: `prompt`, or the checkpoint's
        prompt called prompt_name), tokenised as sentence-transformers does, then truncated as
        params ask and checked."""
        prefix = self.sentence_transformers.prompt(prompt_name, prompt)
        return self.pooling_input(embedding_input_ids(self.tokenizer, text, prefix), params)

    def score_input(self, query: str, document: str, instruction: str | None = None,
                    params: PoolingParams | None = None) -> list[int]:
        """A reranker's input ids for one (query, document) pair (the model card's prompt)."""
        ids = rerank_prompt_ids(self.tokenizer, query, document, instruction)
        return self.pooling_input(ids, params)

    def pooling_input(self, token_ids: list[int], params: PoolingParams | None) -> list[int]:
        """Input ids to embed or score, truncated to their last truncate_prompt_tokens (as vLLM truncates)
        and checked."""
        k = params.truncate_prompt_tokens if params is not None else None
        if k is not None:
            token_ids = token_ids[-k:]
        self.validate_prompt(token_ids, pooling=True)
        return token_ids

    def validate_prompt(self, token_ids: list[int], pooling: bool = False) -> None:
        """pooling: an input to embed or score, which may fill the whole context (no token is
        generated after it)."""
        if not token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        vocab = self.vocab_size
        bad = [t for t in token_ids
               if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]!r:.50} is not in the vocabulary "
                                      f"[0, {vocab})", param="prompt")
        if len(token_ids) > self.max_model_len or (len(token_ids) == self.max_model_len
                                                   and not pooling):
            fix = ("shorten the input, raise max_model_len (--max-model-len) or truncate it "
                   "(truncate_prompt_tokens)" if pooling else
                   "shorten the prompt or raise max_model_len (--max-model-len)")
            raise InvalidRequestError(f"the {'input' if pooling else 'prompt'} has "
                                      f"{len(token_ids)} tokens but max_model_len is "
                                      f"{self.max_model_len}: {fix}")

    def check_sampling_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: its token ids inside this model's vocabulary, and its stop
        lists within this engine's limits (max_stop_sequences, max_stop_token_ids)."""
        ids = params.stop_token_ids or ()
        if len(ids) > self.max_stop_token_ids:
            raise InvalidRequestError(
                f"SamplingParams.stop_token_ids has {len(ids)} ids, more than this engine's limit of "
                f"{self.max_stop_token_ids} (--max-stop-token-ids)", param="stop_token_ids")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"SamplingParams.stop_token_ids: {bad} is not a token id of this model: "
                                      f"ids are in [0, {self.vocab_size})", param="stop_token_ids")
        if len(params.stop) > self.max_stop_sequences:
            raise InvalidRequestError(
                f"SamplingParams.stop has {len(params.stop)} stop strings, more than this engine's limit of "
                f"{self.max_stop_sequences} (--max-stop-sequences)", param="stop")

    def require_task(self, task: str) -> None:
        """An InvalidRequestError saying which model to use unless this model's task is `task`."""
        if task == self.task:
            return
        if self.task == "generate":
            raise InvalidRequestError("this is a generative model (task 'generate'): it does not "
                                      "embed or score; use generate/chat, or load an embedding or "
                                      "reranker model (or pass task='embed'/'score')")
        kind = "an embedding" if task == "embed" else "a reranker"
        raise InvalidRequestError(f"this model's task is {self.task!r}: {task} needs {kind} model "
                                  f"(or task={task!r})")

    def check_task(self, params: SamplingParams | PoolingParams) -> None:
        """Whether params fit this model's task: SamplingParams to generate, PoolingParams to embed
        or score."""
        if isinstance(params, PoolingParams) and self.task == "generate":
            self.require_task("embed")
        if isinstance(params, SamplingParams) and self.task != "generate":
            use = "embed" if self.task == "embed" else "score"
            raise InvalidRequestError(f"this is {'an embedding' if use == 'embed' else 'a reranker'}"
                                      f" model (task {self.task!r}): it does not generate; use "
                                      f"{use}, or load it with task='generate'")
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams (or PoolingParams "
                                      f"for embed/score), got {type(params).__name__}")

    def pooling_request_ids(self, prompt: str | list[int], params: PoolingParams,
                            prompt_token_ids: list[int] | None) -> list[int]:
        """A pooling request's input ids, checked: given ids as they are, an embedding text through
        embedding_input, a reranker prompt (written out already) tokenised as is. An embedding's
        dimensions must fit the model's hidden size."""
        dims = params.dimensions
        if dims is not None and self.task == "embed" and dims > self.hidden_size:
            raise InvalidRequestError(f"dimensions={dims} is more than this model's {self.hidden_size}")
        if prompt_token_ids is not None:
            return self.pooling_input(prompt_token_ids, None)
        if self.task == "embed":
            return self.embedding_input(prompt, params=params)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.pooling_input(ids, params)
