"""LLMEngine: requests in, tokens out, one `step()` at a time.
No I/O, so any front end can drive it.

request -> InputProcessor (tokens, checks) -> Scheduler.schedule (which tokens run)
        -> [proposer: draft tokens] -> ModelRunner.execute (pack, forward, sample)
        -> LLMEngine._postprocess (sequences advance; OutputProcessor: text, stops) -> RequestOutput.

With a speculative_config, a proposer (nanoqwen/spec_decode/proposer.py) fills in draft tokens for the
decoding sequences the scheduler gave draft slots, and the step verifies them
(nanoqwen/sample/rejection_sampler.py): each such sequence may get several tokens per step.

With tensor_parallel_size N > 1 this engine is rank 0: it holds 1/N of the weights and of each KV
block (its heads), schedules and samples; N-1 worker processes (nanoqwen/worker/tp_worker.py) hold the
rest and run every step's forward with it. Call shutdown() (or let the engine be collected) to stop
them.
"""

from __future__ import annotations

import logging
import random
import time
import weakref

import torch

from nanoqwen.config.device import resolve_device, resolve_dtype
from nanoqwen.config.engine import EngineConfig
from nanoqwen.config.pooling import SentenceTransformersConfig, resolve_task
from nanoqwen.config.speculative import DEFAULT_SPEC_MAX_BATCH, SpeculativeConfig
from nanoqwen.core.block_manager import BlockManager
from nanoqwen.core.scheduler import ScheduledBatch, Scheduler, merge_batches, split_by_request
from nanoqwen.core.sequence import Sequence, SequenceStatus
from nanoqwen.engine.input_processor import InputProcessor
from nanoqwen.engine.output_processor import OutputProcessor, RequestState
from nanoqwen.errors import ConfigError, EngineDeadError, InvalidRequestError
from nanoqwen.layers.pooler import make_pooler
from nanoqwen.lora.manager import LoRAManager
from nanoqwen.lora.request import LoRARequest
from nanoqwen.model_loader.hub import resolve_model_path
from nanoqwen.model_loader.loader import load_config, load_generation_config, load_tokenizer
from nanoqwen.models.qwen3 import Qwen3ForCausalLM
from nanoqwen.outputs import PoolingRequestOutput, RequestMetrics, RequestOutput
from nanoqwen.pooling_params import PoolingParams
from nanoqwen.quantization import weight_bytes
from nanoqwen.sample.dry import resolve_dry_breakers
from nanoqwen.sample.structured_outputs import GrammarCompiler
from nanoqwen.sampling_params import SamplingParams
from nanoqwen.spec_decode.proposer import DraftModelProposer, NgramProposer, check_same_tokenizer
from nanoqwen.spec_decode.spec_switch import SpecDecodeSwitch
from nanoqwen.tokenizer import IncrementalDetokenizer
from nanoqwen.worker.kernel_selection import describe_kernels
from nanoqwen.worker.loading import load_model_with_kernels
from nanoqwen.worker.memory import kv_cache_blocks, kv_cache_budget
from nanoqwen.worker.model_runner import ModelRunner, PooledOutput, SampledTokens
from nanoqwen.worker.tp_worker import KVCacheSize, LoadModel, TPGroup

logger = logging.getLogger("nanoqwen")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        """Load the model and tokenizer, size the KV cache, and start the tensor-parallel workers if
        any."""
        self.engine_config = config
        self.quantization = config.quantization
        self.model_dir = resolve_model_path(str(config.model), config.gguf_file)
        self.config = load_config(self.model_dir)
        # "generate", or a pooling task ("embed", "score": nanoqwen/config/pooling.py)
        self.task = resolve_task(self.model_dir, config.task)
        config.check_for_model(self.config, self.task, self.model_dir / "config.json")
        self.generation_config = load_generation_config(self.model_dir, self.config.eos_token_id)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.config.torch_dtype, self.device)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = frozenset(self.generation_config.eos_token_id or self.config.eos_token_id)
        if not self.eos_token_ids and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = frozenset({self.tokenizer.eos_token_id})
        self.tp_group: TPGroup | None = None
        if config.tensor_parallel_size > 1:
            # under torchrun, ranks > 0 become workers in here and never return
            self.tp_group = TPGroup.start(config.tensor_parallel_size, self.device, self.model_dir)
            self.device = self.tp_group.device
            weakref.finalize(self, self.tp_group.shutdown)
        try:
            num_blocks = self._load()
        except BaseException as e:
            if self.tp_group is None:
                raise
            dead = self.tp_group.startup_failure(e)
            if dead is None:
                raise
            raise dead from e
        spec = config.speculative_config
        self.input_processor = InputProcessor(self.tokenizer, self.config, config, self.max_model_len, self.task,
                                              self.generation_config,
                                              SentenceTransformersConfig.from_dir(self.model_dir))
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            self.max_model_len, num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            spec_max_batch=(spec.disable_by_batch_size or DEFAULT_SPEC_MAX_BATCH) if spec else 0,
            num_scheduler_steps=config.num_scheduler_steps,
            max_seqs_per_request_step=config.max_seqs_per_request_step,
            max_loras=config.max_loras if config.enable_lora else 0)
        # proposed and accepted draft tokens, and verification steps, since start (/metrics)
        self.spec_stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.spec_switch = (SpecDecodeSwitch() if spec is not None and spec.disable_by_acceptance
                            else None)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        seed = config.seed if config.seed is not None else random.randrange(2**63)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.requests: dict[str, RequestState] = {}
        self._warned_broken_logits = False
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.config.vocab_size,
                                                self.eos_token_ids)

    def _load(self) -> int:
        """Load the weights (this rank's shard, with the kernels chosen for this engine) and size the KV
        cache (the workers do the same with theirs); return the number of KV blocks."""
        config, c = self.engine_config, self.config
        limit = c.max_position_embeddings
        max_len = config.max_model_len or limit
        tp = self.tp_group
        if tp is not None:
            tp.send(LoadModel(str(self.model_dir), self.dtype, max_len, config.enforce_eager, self.quantization,
                              max_loras=config.max_loras if config.enable_lora else 0,
                              max_lora_rank=config.max_lora_rank))
        model = load_model_with_kernels(self.model_dir, c, self.dtype, self.device, max_len, config.enforce_eager,
                                        self.quantization, tp_rank=0, tp_size=tp.size if tp else 1,
                                        task=self.task)
        pooler = make_pooler(self.task, model, self.tokenizer)  # None for a generative model
        self.weight_bytes = weight_bytes(model)  # this rank's
        # every rank's (filled in below under tensor parallelism)
        self.rank_weight_bytes = [self.weight_bytes]
        logger.info("weights: %.2f GiB in memory (%s)", self.weight_bytes / 2**30,
                    self.quantization or str(self.dtype).removeprefix("torch."))
        self.kernel_path = describe_kernels(model.kernels, self.device, self.dtype, config.enforce_eager,
                                            self.quantization)
        logger.info("kernels: %s", self.kernel_path)
        # The KV pool: as many blocks as the budget holds; it must fit at least one full-length
        # sequence. With tensor parallelism the budget is per rank, and a rank's block holds only
        # its heads.
        spec = config.speculative_config
        draft = (self._load_draft(spec, model, max_len)
                 if spec is not None and spec.method != "ngram" else None)
        block_size = config.block_size
        budget = kv_cache_budget(config.kv_cache_memory, self.device)
        num_blocks = kv_cache_blocks([m for m in (model, draft) if m is not None], self.dtype, block_size,
                                     budget, config.kv_cache_dtype)  # the draft's cache too
        capacity = num_blocks * block_size
        self.max_model_len = config.max_model_len or min(limit, capacity)
        if capacity < max(self.max_model_len, 2):
            raise ConfigError(
                f"the KV cache budget of {budget / 2**30:.2f} GiB holds {capacity} tokens, "
                f"fewer than max_model_len={self.max_model_len}: "
                "raise kv_cache_memory or lower max_model_len")
        if self.max_model_len < limit and config.max_model_len is None:
            logger.info("max_model_len set to %d, what the KV cache budget holds",
                        self.max_model_len)
        # LoRA adapters: hooks on the model's projections, the slot pool and the registry (nanoqwen/lora/)
        self.lora = LoRAManager(model, config.max_loras, config.max_lora_rank) if config.enable_lora else None
        self.runner = ModelRunner(model, num_blocks, block_size, max_num_seqs=config.max_num_seqs,
                                  max_model_len=self.max_model_len,
                                  enforce_eager=config.enforce_eager, pooler=pooler, lora=self.lora,
                                  kv_cache_dtype=config.kv_cache_dtype)
        self.proposer: NgramProposer | DraftModelProposer | None = None
        if spec is not None and draft is None:
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif draft is not None:  # its cache has the same blocks (nanoqwen/spec_decode/proposer.py)
            draft_runner = ModelRunner(draft, num_blocks, block_size,
                                       max_num_seqs=config.max_num_seqs,
                                       max_model_len=self.max_model_len,
                                       enforce_eager=config.enforce_eager,
                                       kv_cache_dtype=config.kv_cache_dtype)
            self.proposer = DraftModelProposer(draft_runner, config.max_num_batched_tokens)
        if tp is not None:
            tp.send(KVCacheSize(num_blocks, block_size, config.kv_cache_dtype))  # every rank gets the same blocks
            self.rank_weight_bytes = tp.wait_ready(self.weight_bytes)
        return num_blocks

    def _load_draft(self, spec: SpeculativeConfig, target: Qwen3ForCausalLM,
                    max_model_len: int) -> Qwen3ForCausalLM:
        """The draft model: the target's own weights quantised (self_quantized), or another
        checkpoint that must share the target's tokenizer (draft_model)."""
        if spec.method == "self_quantized":
            draft_dir, draft_config = self.model_dir, self.config
        else:
            draft_dir = resolve_model_path(str(spec.model))
            draft_config = load_config(draft_dir)
            check_same_tokenizer(self.tokenizer, load_tokenizer(draft_dir),
                                 self.config.vocab_size, draft_config.vocab_size, draft_dir)
        draft = load_model_with_kernels(draft_dir, draft_config, self.dtype, self.device, max_model_len,
                                        self.engine_config.enforce_eager, spec.quantization)
        embedding = target.embed_tokens.weight
        if spec.method == "self_quantized" and draft.embed_tokens.weight.dtype == embedding.dtype:
            draft.embed_tokens.weight = embedding  # one copy of the same table (never quantised)
        logger.info("speculative decoding: %s draft (%s, %.2f GiB), %d tokens per step",
                    spec.method, spec.quantization or str(self.dtype).removeprefix("torch."),
                    weight_bytes(draft) / 2**30, spec.num_speculative_tokens)
        return draft

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | PoolingParams | None = None,
                    prompt_token_ids: list[int] | None = None, lora_request: LoRARequest | None = None) -> None:
        """Queue a request (prompt_token_ids, when given, are the already tokenized prompt; they are
        checked as a prompt is). lora_request: the LoRA adapter it runs with (loaded on first use; the engine
        needs enable_lora).

        With PoolingParams (an embedding or reranker model) the request is only prefilled: its one
        output is the embedding or score (give prompt_token_ids from the input processor's
        embedding_input or score_input)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        inputs = self.input_processor
        params = sampling_params or (inputs.default_sampling_params() if self.task == "generate"
                                     else PoolingParams())
        inputs.check_task(params)
        if isinstance(params, PoolingParams):
            return self._add_pooling_request(request_id, prompt, params, prompt_token_ids)
        inputs.check_sampling_params(params)
        token_ids = inputs.tokenize(prompt if prompt_token_ids is None else prompt_token_ids)
        lora_id = self._lora_id(lora_request)
        # every token that ends an answer, as a set made once (checked for every token it samples)
        stop_ids = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seqs = [Sequence(request_id, i, token_ids, params, stop_token_ids=stop_ids, lora_id=lora_id)
                for i in range(params.n)]
        # a grammar (compiled here unless prepare_request did), or a reasoning budget: a GrammarState each
        if params.structured_outputs is not None or params.thinking_token_budget is not None:
            for seq in seqs:
                seq.grammar = self.grammar_compiler.new_state(params.structured_outputs, token_ids,
                                                              params.thinking_token_budget)
        resolve_dry_breakers(params, self.tokenizer)  # DRY's sequence breakers as token ids (cached)
        if params.prompt_logprobs is not None:  # the first answer prefills the prompt: it computes them
            seqs[0].prompt_logprobs = [None]
        for seq in seqs:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            seq.generator = (torch.Generator(self.device).manual_seed(params.seed + seq.index)
                             if params.seed is not None else self.generator)
        # Only the first answer prefills the prompt; the others fork from its cache when it is done.
        seqs[0].forks = seqs[1:]
        for seq in seqs[1:]:
            seq.status = SequenceStatus.FORK_PENDING
        text = prompt if isinstance(prompt, str) else None
        metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.requests[request_id] = RequestState(request_id, text, token_ids, params, seqs, metrics)
        self.scheduler.add(seqs[0])

    def prepare_request(self, params: SamplingParams | PoolingParams) -> None:
        """The slow part of accepting a request, which may run outside the thread that steps the
        engine (the server runs it off its engine loop): compiling its structured-output grammar and
        matching DRY's sequence breakers against the vocabulary (both cached, so add_request finds them
        ready). Raises InvalidRequestError for a bad grammar."""
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            self.grammar_compiler.compile(params.structured_outputs)
        if isinstance(params, SamplingParams):  # DRY's breakers matched against the vocabulary (cached)
            resolve_dry_breakers(params, self.tokenizer)

    def _add_pooling_request(self, request_id: str, prompt: str | list[int],
                             params: PoolingParams, prompt_token_ids: list[int] | None) -> None:
        """One sequence, only prefilled; its output is the embedding or the score."""
        token_ids = self.input_processor.pooling_request_ids(prompt, params, prompt_token_ids)
        seq = Sequence(request_id, 0, token_ids, None, pooling_params=params)
        text = prompt if isinstance(prompt, str) else None
        metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.requests[request_id] = RequestState(request_id, text, token_ids, params, [seq],
                                                 metrics)
        self.scheduler.add(seq)

    def _lora_id(self, lora_request: LoRARequest | None) -> int:
        """The engine's id of a request's adapter (loading it on first use); 0 for none."""
        if lora_request is None:
            return 0
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}",
                                      param="lora_request")
        if self.lora is None:
            raise InvalidRequestError("this engine runs no LoRA adapters: start it with enable_lora=True "
                                      "(--enable-lora)", param="lora_request")
        return self.lora.add(lora_request).lora_id

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter (vLLM's add_lora): requests can then name it. True once it is registered."""
        self._lora_id(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter (vLLM's remove_lora); False if none has that id. An adapter that unfinished
        requests run with is not removed (InvalidRequestError)."""
        if self.lora is None or lora_int_id not in self.lora.registry:
            return False
        lora_id = self.lora.registry[lora_int_id].lora_id
        if any(seq.lora_id == lora_id for state in self.requests.values() for seq in state.seqs):
            raise InvalidRequestError(f"LoRA adapter {lora_int_id} is in use by unfinished requests; remove it "
                                      "once they finish", param="lora_int_id")
        return self.lora.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """The lora_int_id of every registered adapter (vLLM's list_loras)."""
        return set(self.lora.registry) if self.lora is not None else set()

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its cache blocks (a no-op for unknown or finished ids)."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            for seq in state.seqs:
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one batch; return an output for every request that got a new token (or ended with an error
        of its own: a step that fails is run again request by request, see _execute_each)."""
        batch = self.scheduler.schedule()
        if batch.empty:
            return []
        start = time.perf_counter()
        if batch.spec_decode:
            self.proposer.propose(batch.spec_decode)  # seq.spec_token_ids for this step
        proposed = time.perf_counter()
        self.runner.take_prompt_logprobs()  # (none left from a step that raised: its chunks run again)
        try:
            sampled = self._execute(batch)
        except EngineDeadError:
            raise
        except Exception as error:
            if self.tp_group is not None:  # (the other ranks ran the step too: no rerun)
                raise
            batch, sampled, failed = self._execute_each(batch, error)
        else:
            failed = {}
            if self.spec_switch is not None:  # whether drafts pay: their cost, measured
                self.spec_switch.record_step(batch, proposed - start, time.perf_counter() - proposed)
        outputs = self._postprocess(batch, sampled) if not batch.empty else []
        return outputs + [self._end_with_error(request_id, message) for request_id, message in failed.items()]

    def _execute_each(self, batch: ScheduledBatch, error: Exception
                      ) -> tuple[ScheduledBatch, list[SampledTokens] | list[PooledOutput], dict[str, str]]:
        """A step raised: run it again one request at a time, so that a request whose inputs broke it fails
        alone and the others get the tokens they would have had. Returns the batch of the requests that ran,
        their results, and each failed request's error. Where every request of a batch of several fails on its
        own, the failure is no one request's (out of memory, a broken kernel): the step's error is raised,
        and every request fails. (Running a request's part again rewrites the same cache slots.)"""
        parts = split_by_request(batch)
        ran, sampled, failed = [], [], {}
        for request_id, part in parts.items():
            try:
                sampled += self._execute(part)
                ran.append(part)
            except EngineDeadError:
                raise
            except Exception as e:
                failed[request_id] = f"the engine failed on this request: {type(e).__name__}: {e}"
                logger.exception("request %s failed the step; it ends with an error, the others go on", request_id)
        if not ran and len(parts) > 1:
            raise error
        return merge_batches(ran, batch.num_steps), sampled, failed

    def _end_with_error(self, request_id: str, message: str) -> RequestOutput | PoolingRequestOutput:
        """End a request (every answer) with an error of its own, free its blocks; its last output."""
        state = self.requests.pop(request_id)
        output = self.output_processor.make_error_output(state, message)
        for seq in state.seqs:
            self.scheduler.finish(seq)
        return output

    def _execute(self, batch: ScheduledBatch) -> list[SampledTokens] | list[PooledOutput]:
        if self.tp_group is None:
            return self.runner.execute(batch)
        with self.tp_group.guard():  # a failed rank stops the group with an EngineDeadError
            return self.runner.execute(batch)

    def _postprocess(self, batch: ScheduledBatch, sampled: list[SampledTokens] | list[PooledOutput]
                     ) -> list[RequestOutput | PoolingRequestOutput]:
        """Everything that happens to sequences after a step, in order: their computed tokens
        advance (a speculating one's by the drafts accepted too, a multi-step one's by its steps),
        siblings waiting for a prompt start from its cache, each sampled token is appended (text,
        stop checks; what follows a stop is dropped), newly filled blocks join the prefix cache,
        finished sequences free their blocks, and the blocks rejected drafts took go back (a
        multi-step window ends early only when every sequence in it stopped, so its reserved
        blocks are all used or freed). A pooled result (embedding, score) finishes its sequence."""
        for seq, n in batch.prefill:
            seq.num_computed_tokens += n
        if self.task != "generate":
            self._register_blocks(batch)
            return [self._finish_pooled(seq, data) for seq, data in sampled]
        for computed in self.runner.take_prompt_logprobs():  # (a step run again request by request: twice)
            if computed.request_id in self.requests:
                self.output_processor.add_prompt_logprobs(self.requests[computed.request_id].seqs[0], computed)
        new_tokens = {id(s.seq): len(s.token_ids) for s in sampled}
        for seq in batch.decode:  # the tokens fed (one, or one a step with num_scheduler_steps)
            seq.num_computed_tokens += new_tokens[id(seq)]
        batch_size = len(batch.decode) + len(batch.spec_decode)
        for seq, _ in batch.spec_decode:
            self._count_spec(seq, new_tokens[id(seq)], batch_size)
            # the newest token and the accepted drafts are in the cache (the last new token is
            # not); the draft model's cache holds at most what the target's holds
            seq.num_computed_tokens += new_tokens[id(seq)]
            seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens,
                                                seq.num_computed_tokens)
        for s in sampled:  # siblings take the prompt's cache before anything can finish
            if s.seq.status == SequenceStatus.FORK_PENDING:
                self._start_fork(s.seq)
        touched: dict[str, RequestState] = {}
        finished = []
        for seq, token_ids, logprobs in sampled:
            for token_id, token_logprobs in zip(token_ids, logprobs, strict=True):
                if self.output_processor.append_token(seq, token_id, token_logprobs) is not None:
                    finished.append(seq)
                    break  # (tokens after a stop are dropped)
            touched[seq.request_id] = self.requests[seq.request_id]
        # now that the tokens of filled blocks are appended (drafts, several steps' tokens) and
        # before the finished sequences free their blocks
        self._register_blocks(batch)
        for seq in finished:
            self.scheduler.finish(seq)
        for seq, _ in batch.spec_decode:
            seq.spec_token_ids, seq.draft_probs = [], None
            if seq.status == SequenceStatus.RUNNING:
                self.block_manager.trim(seq)
        outputs = []
        for state in touched.values():
            if state.error is not None:  # the model gave an answer no token to pick: the whole request ends
                self._warn_broken_logits()
                outputs.append(self._end_with_error(state.request_id, state.error))
                continue
            outputs.append(self.output_processor.make_output(state))
            if state.finished:
                del self.requests[state.request_id]
        return outputs

    def _warn_broken_logits(self) -> None:
        if not self._warned_broken_logits:
            self._warned_broken_logits = True
            logger.warning("the model in %s gave logits that are NaN or all -inf (a broken checkpoint, or weights "
                           "that overflow in %s?): the requests they reach end with an error; shown once",
                           self.model_dir, str(self.dtype).removeprefix("torch."))

    def _register_blocks(self, batch: ScheduledBatch) -> None:
        for seq in batch.seqs:
            if seq.status == SequenceStatus.RUNNING:
                self.block_manager.register_full_blocks(seq)

    def _count_spec(self, seq: Sequence, num_new_tokens: int, batch_size: int) -> None:
        """Proposed and accepted draft tokens, for the request's metrics and the engine's (and
        the switch that pauses drafts that do not pay)."""
        proposed = len(seq.spec_token_ids)
        if not proposed:
            return
        accepted = num_new_tokens - 1
        m = self.requests[seq.request_id].metrics
        if self.spec_switch is not None and self.spec_switch.judge(seq, num_new_tokens,
                                                                   batch_size):
            m.spec_num_pauses += 1
        m.spec_num_drafts += 1
        m.spec_num_draft_tokens += proposed
        m.spec_num_accepted_tokens += accepted
        self.spec_stats["num_drafts"] += 1
        self.spec_stats["num_draft_tokens"] += proposed
        self.spec_stats["num_accepted_tokens"] += accepted

    def _finish_pooled(self, seq: Sequence, data: torch.Tensor) -> PoolingRequestOutput:
        self.output_processor.pooled(seq, data)
        self.scheduler.finish(seq)
        state = self.requests.pop(seq.request_id)
        return self.output_processor.make_pooling_output(state, self.task)

    def _start_fork(self, seq: Sequence) -> None:
        parent = self.requests[seq.request_id].seqs[0]
        parent.forks = []
        if self.block_manager.fork(parent, seq, self.runner.copy_block):
            self.scheduler.start_forked(seq)
        else:  # no block free for the copy: recompute this sibling's prompt later instead
            seq.status = SequenceStatus.WAITING
            self.scheduler.add(seq)

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine cannot step any more (a tensor-parallel worker
        died)."""
        if self.tp_group is not None:
            self.tp_group.check()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op without them); the engine cannot step
        afterwards."""
        if self.tp_group is not None:
            self.tp_group.shutdown()

    @property
    def kv_cache_stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_blocks": bm.num_blocks, "block_size": bm.block_size,
            "used_blocks": bm.num_blocks - bm.num_free_blocks,
            "peak_used_blocks": bm.peak_used_blocks,
            "usage": 1 - bm.num_free_blocks / bm.num_blocks,
            "prefix_cache_hit_rate": (bm.prefix_hits / bm.prefix_queries
                                      if bm.prefix_queries else 0.0),
            # in blocks, since the engine started
            "prefix_cache_queries": bm.prefix_queries, "prefix_cache_hits": bm.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            **{f"spec_decode_{k}": v for k, v in self.spec_stats.items()},
            "spec_decode_num_pauses": self.spec_switch.num_pauses if self.spec_switch else 0,
            **self.lora_stats,
        }

    @property
    def lora_stats(self) -> dict[str, int | str]:
        """With LoRA adapters: the names of the adapters of running and of waiting requests (comma-separated, as
        vLLM's lora_requests_info gauge labels them) and max_lora; empty without."""
        if self.lora is None:
            return {}

        def names(seqs: list[Sequence]) -> str:
            ids = sorted({seq.lora_id for seq in seqs} - {0})
            return ",".join(self.lora.by_lora_id[i].request.lora_name for i in ids if i in self.lora.by_lora_id)

        return {"lora_running_adapters": names(self.scheduler.running),
                "lora_waiting_adapters": names(list(self.scheduler.waiting)), "max_lora": self.lora.max_loras}
