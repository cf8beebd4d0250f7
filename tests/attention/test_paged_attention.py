"""The GPU fast path's logic, checked on CPU: paged decode attention (reference and Triton kernel),
the paged-decode metadata in the engine, and the CUDA-graph runner's bucket padding and slicing.

What only a GPU can check (graph capture and replay, the Triton kernel compiled for CUDA,
flash-attn) is run by bench/gpu.sh.
"""

from __future__ import annotations

import os

# The Triton kernel runs on CPU tensors only under the interpreter, chosen
# when the kernel is defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import shuffled_decode_rows  # noqa: E402

from nanoqwen import LLM, SamplingParams  # noqa: E402
from nanoqwen.attention import attend
from nanoqwen.attention.backends import paged as paged_attention
from nanoqwen.attention.backends.paged import attention_backend, has_module, paged_decode_attention_reference
from nanoqwen.attention.backends.sdpa import decode_attention  # noqa: E402
from nanoqwen.attention.kv_cache import KVCache  # noqa: E402
from nanoqwen.attention.metadata import AttentionMetadata, DecodeRow, PrefillRow
from nanoqwen.worker import cuda_graph
from nanoqwen.worker.cuda_graph import CUDAGraphRunner, bucket_for, graph_batch_sizes  # noqa: E402

CPU = torch.device("cpu")
needs_triton = pytest.mark.skipif(not has_module("triton"),
                                  reason="requires triton (pip install triton): the kernel test "
                                         "runs it on CPU tensors under TRITON_INTERPRET=1")


def random_cache(groups: int, dtype=torch.float32, num_blocks: int = 24, block_size: int = 4,
                 hkv: int = 2, d: int = 16, seed: int = 0):
    """A one-layer cache of random keys/values, 5 sequences of different lengths on shuffled
    (non-consecutive) blocks, and their queries. Returns cache, q [5, Hq, D], decode
    [(block_table, context_len)]."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(1, num_blocks, block_size, hkv, d, dtype, CPU)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    # a row at each block-boundary case
    decode = shuffled_decode_rows(block_size, num_blocks, g)
    q = torch.randn(len(decode), hkv * groups, d, generator=g).to(dtype)
    return cache, q, decode


def reference(cache: KVCache, q: torch.Tensor, decode, width: int | None = None) -> torch.Tensor:
    meta = AttentionMetadata.build(decode, [], cache.block_size, CPU, paged_backend="torch")
    p = meta.paged_decode
    return paged_decode_attention_reference(q, cache.k[0], cache.v[0], p.block_tables,
                                            p.context_lens, q.shape[-1] ** -0.5)


def fill_unowned(cache: KVCache, decode, value: float) -> None:
    """Write value into every cache slot that lies outside the sequences' contexts."""
    owned = {(table[pos // cache.block_size], pos % cache.block_size)
             for table, n in decode for pos in range(n)}
    for blk in range(cache.num_blocks):
        for off in range(cache.block_size):
            if (blk, off) not in owned:
                cache.k[0, blk, off] = value
                cache.v[0, blk, off] = value


# --- buckets --------------------------------------------------------------------------------------

def test_graph_batch_sizes_and_bucket_choice():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(1) == [1]
    sizes = graph_batch_sizes(256)
    assert (sizes[:8] == [1, 2, 4, 8, 16, 24, 32, 48] and sizes[-1] == 256
            and all(s % 16 == 0 for s in sizes[6:]))
    assert graph_batch_sizes(10_000)[-1] == cuda_graph.MAX_GRAPH_BATCH
    for b in range(1, 257):
        size = bucket_for(sizes, b)
        # the smallest bucket that holds b rows
        assert size >= b and not any(b <= s < size for s in sizes)
    assert bucket_for(sizes, 257) is None


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("NANOQWEN_PAGED_ATTENTION", raising=False)
    cuda = torch.device("cuda")  # only the choice is tested: no GPU is touched
    assert attention_backend(CPU, 16) is None  # CPU keeps the grouped gather path
    monkeypatch.setattr(paged_attention, "has_module", lambda name: True)
    # flash-attn 2 needs blocks of a multiple of 256 tokens
    assert attention_backend(cuda, 16) == "triton"
    assert attention_backend(cuda, 256) == "flash"
    monkeypatch.setattr(paged_attention, "has_module", lambda name: name == "triton")
    assert attention_backend(cuda, 256) == "triton"
    monkeypatch.setattr(paged_attention, "has_module", lambda name: False)
    assert attention_backend(cuda, 16) is None
    monkeypatch.setenv("NANOQWEN_PAGED_ATTENTION", "torch")
    assert attention_backend(CPU, 16) == "torch"
    monkeypatch.setenv("NANOQWEN_PAGED_ATTENTION", "off")
    assert attention_backend(cuda, 16) is None
    monkeypatch.setenv("NANOQWEN_PAGED_ATTENTION", "fast")
    with pytest.raises(ValueError, match="NANOQWEN_PAGED_ATTENTION"):
        attention_backend(cuda, 16)


def test_backend_choice_takes_the_dtype_and_device_into_account(monkeypatch):
    """flash-attn computes in 16-bit only: auto picks triton for a float32 cache; a backend named in the
    environment that cannot run this engine's cache is refused at start, naming the variable."""
    monkeypatch.delenv("NANOQWEN_PAGED_ATTENTION", raising=False)
    cuda = torch.device("cuda")  # only the choice is tested: no GPU is touched
    monkeypatch.setattr(paged_attention, "has_module", lambda name: True)
    assert attention_backend(cuda, 256, torch.bfloat16) == "flash"
    assert attention_backend(cuda, 256, torch.float16) == "flash"
    assert attention_backend(cuda, 256, torch.float32) == "triton"
    for choice, device, block_size, dtype in (("flash", cuda, 256, torch.float32), ("flash", CPU, 256, torch.bfloat16),
                                              ("flash", cuda, 16, torch.bfloat16), ("cpu", cuda, 16, torch.bfloat16),
                                              ("cpu", CPU, 16, torch.float32)):
        monkeypatch.setenv("NANOQWEN_PAGED_ATTENTION", choice)
        with pytest.raises(ValueError, match=f"NANOQWEN_PAGED_ATTENTION={choice}: .*unset it"):
            attention_backend(device, block_size, dtype)
    for choice, device, dtype in (("flash", cuda, torch.bfloat16), ("cpu", CPU, torch.bfloat16),
                                  ("triton", CPU, torch.float32), ("torch", cuda, torch.float32)):
        monkeypatch.setenv("NANOQWEN_PAGED_ATTENTION", choice)
        assert attention_backend(device, 256, dtype) == choice


# --- the paged attention reference ----------------------------------------------------------------

@pytest.mark.parametrize("groups", [1, 2, 4, 5])
def test_paged_reference_equals_the_gather_path(groups):
    """The reference over block tables == the CPU path (decode groups, gathered blocks, SDPA)."""
    cache, q, decode = random_cache(groups, seed=groups)
    expected = torch.empty_like(q)
    meta = AttentionMetadata.build(decode, [], cache.block_size, CPU)
    assert len(meta.decode_groups) >= 2 and meta.paged_decode is None
    for group in meta.decode_groups:
        k, v = cache.decode_context(0, group)
        expected[group.start: group.end] = decode_attention(q[group.start: group.end], k, v,
                                                            group.mask)
    torch.testing.assert_close(reference(cache, q, decode), expected, atol=1e-5, rtol=1e-5)


def test_paged_reference_ignores_what_lies_past_each_context_and_pads_with_zeros():
    cache, q, decode = random_cache(2)
    before = reference(cache, q, decode)
    fill_unowned(cache, decode, 1e4)  # rewrite every slot no sequence holds
    torch.testing.assert_close(reference(cache, q, decode), before)
    # a padding row (context_len 0, as CUDA graphs add) attends to nothing: zeros, and the others
    # are unchanged
    meta = AttentionMetadata.build(decode, [], cache.block_size, CPU, paged_backend="torch")
    p = meta.paged_decode
    tables = torch.cat([p.block_tables, torch.zeros_like(p.block_tables[:1])])
    lens = torch.cat([p.context_lens, torch.zeros(1, dtype=torch.int32)])
    out = paged_decode_attention_reference(torch.cat([q, q[:1]]), cache.k[0], cache.v[0], tables,
                                           lens, 0.25)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    torch.testing.assert_close(out[:-1], before)


# --- the Triton kernel, under the interpreter -----------------------------------------------------

@needs_triton
@pytest.mark.parametrize("groups", [1, 2, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_equals_reference(triton_kernel, groups, dtype):
    cache, q, decode = random_cache(groups, dtype=dtype, seed=10 + groups)
    expected = reference(cache, q, decode)
    # slots past the contexts: the kernel must never read them
    fill_unowned(cache, decode, float("nan"))
    meta = AttentionMetadata.build(decode, [], cache.block_size, CPU, paged_backend="triton")
    p = meta.paged_decode
    # a padding row, and table columns wider than needed (as in a graph's static buffer)
    tables = torch.nn.functional.pad(torch.cat([p.block_tables, p.block_tables[:1]]), (0, 3),
                                     value=0)
    lens = torch.cat([p.context_lens, torch.zeros(1, dtype=torch.int32)])
    out = torch.full((q.shape[0] + 1, *q.shape[1:]), float("nan"), dtype=dtype)
    # block_n 16 = 4 blocks per iteration: rows of 1 to 5 iterations, partial last ones
    triton_kernel(torch.cat([q, q[:1]]), cache.k[0], cache.v[0], tables, lens, q.shape[-1] ** -0.5,
                  out=out, block_n=16)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out[:-1], expected, **tol)


# --- the engine -----------------------------------------------------------------------------------

PROMPTS = [[9707, 11, 847, 829, 374],
           [785, 6722, 315, 9625, 374, 264, 1293, 11652, 9934, 13, 576],
           [40],
           [3838, 374, 279, 7290, 315, 2272, 30, 358, 1744, 432, 374, 220, 19, 17, 13, 2055, 1128]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("gqa2-untied", dtype="float32")


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs = {"max_model_len": 64, "kv_cache_memory": 4 << 20, "block_size": 4, **kwargs}
    return LLM(model_dir, dtype="float32", device="cpu", **kwargs)


@pytest.fixture(scope="module")
def expected(model_dir):
    """The default CPU path (grouped gather), requests arriving together."""
    llm = make_llm(model_dir)
    assert (llm.llm_engine.runner.attention_backend is None
            and llm.llm_engine.runner.graph_runner is None)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def count_calls(monkeypatch, module, name: str) -> list:
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_engine_with_paged_decode_reference_gives_the_default_tokens(model_dir, expected,
                                                                      monkeypatch):
    monkeypatch.setenv("NANOQWEN_PAGED_ATTENTION", "torch")
    # mixed prefill/decode steps too
    llm = make_llm(model_dir, enforce_eager=True, max_num_batched_tokens=8)
    runner = llm.llm_engine.runner
    assert runner.attention_backend == "torch" and runner.graph_runner is None
    calls = count_calls(monkeypatch, attend, "paged_decode_attention")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert calls and all(c[-1] == "torch" for c in calls)


@pytest.mark.parametrize("chunked", [False, True])
def test_padded_static_buffer_runner_gives_the_default_tokens(model_dir, expected, monkeypatch,
                                                              chunked):
    """The CUDA-graph runner's path, run eagerly on CPU: steps of b sequences padded to the bucket,
    then sliced. chunked: prompts split into 8-token chunks, so many steps mix prompt chunks and
    decodes (those run eagerly)."""
    monkeypatch.setenv("NANOQWEN_PAGED_ATTENTION", "torch")
    llm = make_llm(model_dir, max_num_seqs=4, max_num_batched_tokens=8 if chunked else 64)
    engine = llm.llm_engine
    graphs = engine.runner.graph_runner
    assert graphs is not None and not graphs.use_graphs and graphs.batch_sizes == [1, 2, 4]
    # the scratch block for padding rows is outside what the block manager hands out
    assert engine.runner.kv_cache.k.shape[1] == engine.block_manager.num_blocks + 1
    assert graphs.scratch_slot == (engine.block_manager.num_blocks
                                   * engine.runner.kv_cache.block_size)
    sizes, steps = [], []
    original_run, original_forward = graphs.run, graphs.forward
    monkeypatch.setattr(graphs, "run",
                        lambda ids, decode: sizes.append(len(decode)) or original_run(ids, decode))
    monkeypatch.setattr(graphs, "forward",
                        lambda size: steps.append(size) or original_forward(size))
    batches = count_calls(monkeypatch, engine.runner, "execute")
    # answers of different lengths, so decode batches shrink from 4 rows to 1 (3 rows run padded
    # to 4)
    lengths = [12, 9, 5, 2]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [e[:n] for e, n in zip(expected, lengths, strict=True)]
    assert steps == [bucket_for(graphs.batch_sizes, b) for b in sizes]
    # exactly the steps without prompt chunks went through the runner, the others ran eagerly
    decode_only = [len(batch.decode) for (batch,) in batches if not batch.prefill]
    assert sizes == decode_only and len(batches) > len(sizes) > 0
    if not chunked:
        assert set(sizes) == {1, 2, 3, 4}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_padding_rows_do_not_change_the_real_rows(model_dir, monkeypatch):
    """A step of 3 sequences padded to a bucket of 4 gives the logits of the same step run
    eagerly, unpadded."""
    monkeypatch.setenv("NANOQWEN_PAGED_ATTENTION", "torch")
    model = make_llm(model_dir, enforce_eager=True).llm_engine.model
    c, bs = model.config, 4
    cache = KVCache(c.num_hidden_layers, 40, bs, c.num_key_value_heads, c.head_dim, torch.float32,
                    CPU)
    graphs = CUDAGraphRunner(model, cache, scratch_slot=39 * bs, max_num_seqs=8,
                             max_blocks_per_seq=9, backend="torch", use_graphs=False)
    # interleaved blocks, 9 per sequence; block 39 is scratch
    tables = [list(range(i, 27, 3)) for i in range(3)]
    prompts = PROMPTS[:3]
    decode = [DecodeRow(t, len(p) + 1) for t, p in zip(tables, prompts, strict=True)]
    with torch.inference_mode():
        prefill = [PrefillRow(t, 0, len(p)) for t, p in zip(tables, prompts, strict=True)]
        meta = AttentionMetadata.build([], prefill, bs, CPU)
        model(torch.tensor([t for p in prompts for t in p]), meta.positions, cache, meta)
        meta = AttentionMetadata.build(decode, [], bs, CPU, paged_backend="torch")
        eager = model.compute_logits(model(torch.tensor([11, 22, 33]), meta.positions, cache, meta))
        # stale contents, as a previous step of 8 rows would leave them
        graphs.block_tables.fill_(7)
        graphs.context_lens.fill_(5)
        # block 0 is sequence 0's: a padding row writing there would corrupt it
        graphs.slot_mapping.fill_(0)
        graphs.positions.fill_(3)
        logits = graphs.run([11, 22, 33], decode)
    assert logits.shape == (3, c.vocab_size)
    assert (graphs.context_lens[3] == 0 and graphs.slot_mapping[3] == 39 * bs
            and graphs.input_ids[3] == 0)
    torch.testing.assert_close(logits, eager, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("eager", [True, False])
def test_engine_with_the_triton_kernel_gives_the_default_tokens(model_dir, expected, triton_kernel,
                                                                monkeypatch, eager):
    """The kernel inside the model (strided q/out row slices, the real cache layout), under the
    interpreter; eager=False: on the graph runner's padded static buffers (tables as wide as
    max_model_len allows)."""
    monkeypatch.setenv("NANOQWEN_PAGED_ATTENTION", "triton")
    llm = make_llm(model_dir, enforce_eager=eager, max_num_seqs=4)
    assert (llm.llm_engine.runner.graph_runner is None) == eager
    calls = count_calls(monkeypatch, attend, "paged_decode_attention")
    # 3 sequences: the graph runner pads them to 4 rows, one of them empty (context_len 0)
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)] == expected[:3]
    assert calls and all(c[-1] == "triton" for c in calls)
