"""Tensor parallelism on CPU (gloo, real worker processes): TP=2 gives TP=1's tokens, each rank
holds and reads half the weights, bad sizes are refused, and a dead or failing worker stops the
engine within seconds."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import torch.distributed as dist
from conftest import PROMPTS as LOOPING
from conftest import SYSTEM, make_llm, tiny_config
from gguf_files import T as GGUF_TYPES
from gguf_files import write_gguf
from quantized_checkpoints import write_quantized

import nanoqwen.distributed as distributed
import nanoqwen.model_loader.loader as loader
from nanoqwen import LLM, ConfigError, EngineDeadError, SamplingParams
from nanoqwen.config.model import Qwen3Config, check_tensor_parallel_size
from nanoqwen.distributed import free_port
from nanoqwen.model_loader.init_random import preset_config, write_random_model

# a hang fails the test instead of blocking the run
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.usefixtures("one_thread_per_rank")]

PROMPTS = [
    SYSTEM + [9707, 11, 847, 829, 374],
    SYSTEM + [785, 6722, 315, 9625, 374, 264, 1293, 11652, 9934],
    [40, 1079],
    [3838, 374, 279, 7290, 315, 2272, 30],
    SYSTEM + [9707, 11, 847, 829, 374, 1207],
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
SAMPLED = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True)
# (conftest shape, overrides): GQA ratios 1/2/4, tied and untied heads, head_dim != hidden/heads,
# several weight files, and attention biases (the row-parallel o_proj bias lives on rank 0 only).
CASES = {
    "gqa1-tied-headdim": ("gqa1-tied-headdim", {}),
    "gqa2-untied": ("gqa2-untied", {}),
    "gqa4-sharded": ("gqa4-sharded", {"max_shard_bytes": 20 << 20}),
    "gqa2-bias": ("gqa2-untied", {"attention_bias": True}),
    # Qwen3-MoE (8 experts, top-2, layer 1 dense), experts stored per expert as on the hub, or fused
    # as transformers 5 saves them; and every other layer sparse, top-3 of 6, no renormalisation,
    # tied head
    "moe-per-expert": ("moe", {}),
    "moe-fused": ("moe", {"fused_experts": True}),
    "moe-step2-tied": ("moe", {"num_hidden_layers": 4, "mlp_only_layers": [],
                               "decoder_sparse_step": 2, "num_experts": 6,
                               "num_experts_per_tok": 3, "norm_topk_prob": False,
                               "tie_word_embeddings": True}),
}


@pytest.fixture(scope="module")
def case_dir(checkpoint, tmp_path_factory):
    """case_dir(case) -> a float32 checkpoint folder for one of CASES, written once."""
    made = {}

    def make(case: str):
        name, overrides = CASES[case]
        if case not in made:
            if name == "moe":
                overrides = dict(overrides)
                fused = overrides.pop("fused_experts", False)
                raw = {**preset_config("qwen3-moe-tiny"), **overrides}
                made[case] = write_random_model(tmp_path_factory.mktemp(case), raw,
                                                dtype="float32", std=0.08, fused_experts=fused)
            else:
                made[case] = checkpoint(name, dtype="float32", **overrides)
        return made[case]

    return make


# where steps stay under the compiled kernels' 64 tokens: skip compiling them
EAGER = {"enforce_eager": True}
# what a llama.cpp Q4_K_M file holds beside Q4_K (tests/model_loader/test_gguf.py)
GGUF_Q4_K_M = {"attn_v.weight": GGUF_TYPES.Q6_K, "ffn_down.weight": GGUF_TYPES.Q6_K,
               "token_embd.weight": GGUF_TYPES.Q6_K}


@contextlib.contextmanager
def tp_llm(path, size: int = 2, **kwargs) -> Iterator[LLM]:
    llm = make_llm(path, tensor_parallel_size=size, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.shutdown()
        assert not dist.is_initialized()


def run_all(llm: LLM) -> dict:
    """Greedy over a batch, a prefix-cached repeat, and n=3 seeded samples forked from one
    prompt."""
    batch = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    again = llm.generate([PROMPTS[4]], GREEDY, use_tqdm=False)[0]
    forks = llm.generate([PROMPTS[1]], SAMPLED, use_tqdm=False)[0]
    return {"batch": [o.token_ids for o in batch], "again": again.token_ids,
            "cached": again.num_cached_tokens,
            "forks": [c.token_ids for c in forks.outputs],
            "logprobs": [[e[t].logprob for e, t in zip(o.logprobs, o.token_ids, strict=True)]
                         for o in batch]}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_gives_the_tokens_of_tp1(case_dir, case):
    path = case_dir(case)
    expected = run_all(make_llm(path))
    with tp_llm(path) as llm:
        engine = llm.llm_engine
        assert [w.proc.returncode for w in engine.tp_group.workers] == [None]  # one worker, running
        got = run_all(llm)
        procs = [w.proc for w in engine.tp_group.workers]
    assert [p.returncode for p in procs] == [0]  # stopped cleanly on shutdown
    # the first run's prompt and answer blocks were reused
    assert got["cached"] == expected["cached"] == 16
    for key in ("batch", "again", "forks"):
        assert got[key] == expected[key], key
    assert (len({tuple(t) for t in expected["batch"]}) == len(PROMPTS)
            and len(set(map(tuple, got["forks"]))) == 3)
    for a, b in zip(got["logprobs"], expected["logprobs"], strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def test_tp2_with_the_gpu_decode_attention(case_dir, monkeypatch):
    """The GPU path's paged decode attention (its PyTorch reference backend) on each rank's heads;
    CUDA graphs stay off under tensor parallelism."""
    monkeypatch.setenv("NANOQWEN_PAGED_ATTENTION", "torch")  # the workers inherit it
    path = case_dir("gqa2-untied")
    expected = run_all(make_llm(path, **EAGER))
    with tp_llm(path, **EAGER) as llm:
        runner = llm.llm_engine.runner
        assert runner.attention_backend == "torch" and runner.graph_runner is None
        got = run_all(llm)
    for key in ("batch", "again", "forks"):
        assert got[key] == expected[key], key


def test_tp2_with_a_quantized_kv_cache(case_dir):
    """kv_cache_dtype int8: each rank stores its heads' codes and scales (a scale per token and kv head, so the
    same as TP=1's for those heads)."""
    path = case_dir("gqa2-untied")
    expected = run_all(make_llm(path, kv_cache_dtype="int8"))
    with tp_llm(path, kv_cache_dtype="int8") as llm:
        assert llm.llm_engine.runner.kv_cache.k.dtype == torch.int8
        got = run_all(llm)
    for key in ("batch", "again", "forks"):
        assert got[key] == expected[key], key
    for a, b in zip(got["logprobs"], expected["logprobs"], strict=True):  # (a bf16-cache rank would move them)
        assert a == pytest.approx(b, abs=1e-4)


def test_tp2_under_preemption_and_chunked_prefill(checkpoint):
    """A KV pool too small for the batch (preemptions) and 3-token steps (chunked prefill) on both
    ranks."""
    path = checkpoint("gqa2-untied", dtype="float32")
    # TP=1: k and v, 2 layers, 2 kv heads, head_dim 16, float32; TP=2: half
    per_token = 2 * 2 * 2 * 16 * 4
    kwargs = {"max_model_len": 52, "max_num_batched_tokens": 3, "max_num_seqs": 3, **EAGER}
    ref = make_llm(path, kv_cache_memory=52 * per_token, **kwargs)
    expected = [o.token_ids for o in ref.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with tp_llm(path, kv_cache_memory=52 * per_token // 2, **kwargs) as llm:
        assert (llm.llm_engine.block_manager.num_blocks
                == ref.llm_engine.block_manager.num_blocks == 13)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        assert (llm.llm_engine.scheduler.num_preemptions
                == ref.llm_engine.scheduler.num_preemptions > 0)


def test_tp2_structured_outputs_give_the_answers_of_tp1(checkpoint):
    """Rank 0 gathers the logits, masks them with each row's grammar and samples: the constrained
    answers (greedy and seeded, beside an unconstrained one) are TP=1's."""
    from nanoqwen.sampling_params import StructuredOutputsParams

    path = checkpoint("gqa2-untied", dtype="float32")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99},
                                               "tag": {"type": "string", "maxLength": 4}},
              "required": ["n", "tag"], "additionalProperties": False}
    constrained = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=constrained),
              SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex="[a-z]{2,5}!")),
              GREEDY]
    expected = [o.token_ids for o in make_llm(path, **EAGER).generate(PROMPTS[:3], params,
                                                                     use_tqdm=False)]
    with tp_llm(path, **EAGER) as llm:
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert outs[0].finish_reason == "stop" and set(json.loads(outs[0].text)) == {"n", "tag"}
    assert re.fullmatch("[a-z]{2,5}!", outs[1].text)


def test_tp2_ngram_speculation_gives_the_answers_of_tp1(checkpoint):
    """N-gram drafts verified on both ranks (the drafts' rows are decode rows of the broadcast
    step): greedy answers are TP=1's without speculation. (These prompts' answers fall into
    loops, so drafts get accepted.)"""
    path = checkpoint("gqa2-untied", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in make_llm(path, **EAGER).generate(LOOPING, params,
                                                                     use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
            "prompt_lookup_min": 1, "disable_by_batch_size": len(LOOPING)}
    with tp_llm(path, speculative_config=spec, **EAGER) as llm:
        assert [o.token_ids for o in llm.generate(LOOPING, params, use_tqdm=False)] == expected
        assert llm.llm_engine.spec_stats["num_accepted_tokens"] > 0


# ---------------------------------------------------------------- sharded loading


# quantised checkpoints whose quantisation groups (AWQ's 128, FP8's blocks of 128, K-quant super-blocks of 256) a
# rank's share of o_proj's and down_proj's inputs does not split
QUANTIZED_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=64)


@pytest.mark.parametrize("kind", ["awq", "fp8", "gguf-q4_k_m"])
def test_tp2_runs_a_quantized_checkpoint_as_tp1_does(checkpoint, tmp_path, kind):
    """An AWQ or FP8 checkpoint and a Q4_K_M GGUF file (its Q6_K table tied, quantised) run over two ranks, each
    holding its share of the file's own quantised matrices, with TP=1's tokens."""
    if kind == "gguf-q4_k_m":
        path, _ = write_gguf(tmp_path, tiny_config(**QUANTIZED_SHAPE), GGUF_Q4_K_M, GGUF_TYPES.Q4_K)
    else:
        path, _, _ = write_quantized(checkpoint("tiny", dtype="float32", **QUANTIZED_SHAPE), tmp_path, kind)
    expected = run_all(make_llm(path, **EAGER))
    with tp_llm(path, **EAGER) as llm:
        got = run_all(llm)
    for key in ("batch", "again", "forks"):
        assert got[key] == expected[key], key
    for a, b in zip(got["logprobs"], expected["logprobs"], strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def expected_shard(name: str, full: torch.Tensor, rank: int,
                   config: Qwen3Config) -> torch.Tensor | None:
    """What rank `rank` of 2 must hold of a TP=1 parameter, rebuilt without the loader's table."""
    def half(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(2, dim)[rank]

    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        return torch.cat([half(p, 0) for p in full.split([q, kv, kv])])
    if name.endswith("gate_up_proj.weight"):
        return torch.cat([half(p, 0) for p in full.chunk(2)])
    if name.endswith(("o_proj.weight", "mlp.down_proj.weight")):
        return half(full, 1)
    if name.endswith("experts.gate_up_proj"):
        # [E, 2Ie, H]: each expert's gate rows, then its up rows
        return torch.cat([half(p, 1) for p in full.chunk(2, dim=1)], dim=1)
    if name.endswith("experts.down_proj"):  # [E, H, Ie]
        return half(full, 2)
    if name.endswith("o_proj.bias"):
        return full if rank == 0 else None
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return half(full, 0)
    return full  # norms: replicated


@pytest.mark.parametrize("case", ["gqa4-sharded", "gqa2-bias", "gqa1-tied-headdim",
                                  "moe-per-expert", "moe-fused"])
def test_each_rank_reads_and_holds_only_its_half(case_dir, case, monkeypatch):
    path = case_dir(case)
    config = loader.load_config(path)
    read = [0]
    iter_checkpoint = loader.iter_checkpoint

    def counting(*args, **kwargs):
        for item in iter_checkpoint(*args, **kwargs):
            read[0] += item[2].numel() * item[2].element_size()
            yield item

    monkeypatch.setattr(loader, "iter_checkpoint", counting)
    cpu = torch.device("cpu")
    full = loader.load_model(path, config, torch.float32, cpu, 64)
    full_read, read[0] = read[0], 0
    full_params = dict(full.named_parameters())
    full_bytes = sum(p.numel() * p.element_size() for p in full_params.values())
    for rank in range(2):
        shard = loader.load_model(path, config, torch.float32, cpu, 64, tp_rank=rank, tp_size=2)
        params = dict(shard.named_parameters())
        for pname, value in full_params.items():
            want = expected_shard(pname, value, rank, config)
            assert (pname in params) == (want is not None), pname
            if want is not None:
                assert torch.equal(params[pname], want), pname
        assert shard.is_tied == full.is_tied
        held = sum(p.numel() * p.element_size() for p in params.values()) / full_bytes
        rank_read, read[0] = read[0] / full_read, 0
        # half of everything but the replicated norms (and, on rank 0, the o_proj biases)
        assert 0.5 <= held < 0.52 and 0.5 <= rank_read < 0.52, (rank, held, rank_read)


def test_iter_checkpoint_reads_planned_ranges_in_row_blocks(tmp_path):
    from safetensors.torch import save_file

    tensors = {"a": torch.arange(24.0).view(6, 4), "b": torch.arange(36.0).view(3, 2, 6),
               "c": torch.arange(5.0)}
    save_file(tensors, tmp_path / "m.safetensors")
    plans = {"a": (0, [(0, 1), (3, 5)]), "b": (2, [(0, 2), (4, 6)]), "c": None}
    got: dict[str, torch.Tensor] = {}
    pieces = loader.iter_checkpoint([tmp_path / "m.safetensors"], group_bytes=16,
                                    plan=lambda name, shape: plans[name])
    for name, first_row, rows in pieces:
        assert rows.shape[0] == 1  # 16-byte groups: one row at a time
        part = got.setdefault(name, torch.full((3, *rows.shape[1:]), -1.0))
        part[first_row: first_row + 1] = rows
    assert set(got) == {"a", "b"}  # "c" skipped
    assert torch.equal(got["a"], tensors["a"][[0, 3, 4]])
    assert torch.equal(got["b"], torch.cat([tensors["b"][..., 0:2], tensors["b"][..., 4:6]], dim=2))


def test_misshaped_tensor_is_reported_with_full_shapes(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    src = checkpoint("gqa2-untied", dtype="float32")
    dst = tmp_path / "m"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dst / "model.safetensors")
    down = "model.layers.1.mlp.down_proj.weight"
    tensors[down] = tensors[down][:, :64].clone()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = loader.load_config(dst)
    with pytest.raises(loader.WeightsError,
                       match=r"down_proj.weight' has shape \[64, 64\] in the checkpoint, "
                             r"but config.json implies \[64, 128\]"):
        loader.load_model(dst, config, torch.float32, torch.device("cpu"), 64, tp_rank=1, tp_size=2)


# ---------------------------------------------------------------- refusals


def config(**overrides) -> Qwen3Config:
    return Qwen3Config.from_dict({**preset_config("tiny"), **overrides})


def test_sizes_that_do_not_divide_are_refused_with_the_valid_ones():
    check_tensor_parallel_size(config(), 2)
    with pytest.raises(ConfigError,
                       match=r"tensor_parallel_size=4 does not divide num_key_value_heads=2 "
                             r"of this model; valid sizes: 1, 2$"):
        check_tensor_parallel_size(config(), 4)
    with pytest.raises(ConfigError,
                       match=r"=3 does not divide num_attention_heads=4, num_key_value_heads=2, "
                             r"intermediate_size=128, vocab_size=151936 of this model; "
                             r"valid sizes: 1, 2$"):
        check_tensor_parallel_size(config(), 3)
    with pytest.raises(ConfigError, match=r"does not divide vocab_size=1001 .*valid sizes: 1$"):
        check_tensor_parallel_size(config(vocab_size=1001), 2)
    with pytest.raises(ConfigError,
                       match=r"=8 does not divide intermediate_size=100 of this model; "
                             r"valid sizes: 1, 2, 4$"):
        check_tensor_parallel_size(config(intermediate_size=100, num_attention_heads=8,
                                          num_key_value_heads=8), 8)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="must be an integer >= 1"):
            check_tensor_parallel_size(config(), bad)


def test_llm_refuses_before_starting_anything(checkpoint, monkeypatch):
    path = checkpoint("gqa2-untied", dtype="float32")
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started a worker"))
    with pytest.raises(ConfigError,
                       match="tensor_parallel_size=4 does not divide num_key_value_heads=2"):
        make_llm(path, tensor_parallel_size=4)
    assert not dist.is_initialized()
    monkeypatch.undo()
    # under torchrun the group is torchrun's: its size must be the tensor-parallel size
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError,
                       match="torchrun started 4 processes but tensor_parallel_size is 2"):
        make_llm(path, tensor_parallel_size=2)
    assert not dist.is_initialized()


def test_a_second_engine_is_refused_and_leaves_the_running_one_alone(checkpoint, monkeypatch):
    """One tensor-parallel group per process: a second TP engine is refused before it starts a
    worker, and the first keeps working (the refused one's clean-up must not tear down its
    group)."""
    path = checkpoint("gqa2-untied", dtype="float32")
    with tp_llm(path, **EAGER) as llm:
        def greedy() -> list[list[int]]:
            return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]

        expected = greedy()
        started = []
        monkeypatch.setattr(subprocess, "Popen",
                            lambda *a, **k: started.append(a) or pytest.fail("started"))
        with pytest.raises(ConfigError,
                           match="a tensor-parallel group is already running in this process"):
            make_llm(path, tensor_parallel_size=2, **EAGER)
        monkeypatch.undo()
        assert not started and dist.is_initialized()
        assert greedy() == expected


# ---------------------------------------------------------------- failures


def test_a_workers_joining_report_is_kept_whichever_read_takes_it():
    """Rank 0 reads a worker's pipe in two places while it waits for "joining" (the wait itself, and
    the health check that looks for errors); a report taken by the health check must still count (CI
    once lost it and waited out the join timeout)."""
    from multiprocessing.connection import Connection

    from nanoqwen.worker.tp_worker import Joining, TPGroup, Worker

    group = TPGroup(2, torch.device("cpu"))
    read_fd, write_fd = os.pipe()
    conn = Connection(read_fd, writable=False)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    group.workers.append(Worker(1, sleeper, conn))
    try:
        with Connection(write_fd, readable=False) as worker_end:
            worker_end.send(Joining())
        assert group.failure() is None  # the health check reads the pipe first
        # no time to wait: the report the health check took must already count (else this raises)
        group._wait_for_workers(Joining(), timeout=0.0)
    finally:
        group.workers[0].proc.kill()
        group.workers[0].proc.wait()
        group.workers[0].conn.close()



def test_killed_worker_stops_the_engine(checkpoint, monkeypatch):
    path = checkpoint("gqa2-untied", dtype="float32")
    llm = make_llm(path, tensor_parallel_size=2, max_model_len=4096, kv_cache_memory=16 << 20,
                   **EAGER)
    worker = llm.llm_engine.tp_group.workers[0].proc
    killed_at = []

    def kill() -> None:
        os.kill(worker.pid, signal.SIGKILL)
        killed_at.append(worker.pid)

    timer = threading.Timer(1.0, kill)
    timer.start()
    try:  # 4 x 4000 tokens: far more than 1 s of steps, so the kill lands mid-run
        with pytest.raises(EngineDeadError,
                           match=rf"tensor-parallel worker 1 \(pid {worker.pid}\) was killed by "
                                 r"SIGKILL; the tensor-parallel group is stopped"):
            llm.generate([PROMPTS[2]] * 4, SamplingParams(max_tokens=4000, ignore_eos=True),
                         use_tqdm=False)
    finally:
        timer.cancel()
    assert killed_at  # (the error came after the kill, not from something else)
    assert not dist.is_initialized() and worker.returncode == -signal.SIGKILL
    # and it stays dead: the next call fails without trying a collective
    collectives = []
    monkeypatch.setattr(distributed, "broadcast_object", lambda *a: collectives.append(a))
    with pytest.raises(EngineDeadError, match="was killed by SIGKILL"):
        llm.generate([PROMPTS[2]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not collectives
    assert not llm.llm_engine.requests and llm.llm_engine.block_manager.num_free_blocks == \
        llm.llm_engine.block_manager.num_blocks


@pytest.fixture
def default_sigint():
    """Ctrl-C as in a terminal, even where pytest was started in the background (a shell without job
    control starts it with SIGINT ignored, and the engine rightly leaves an ignored SIGINT alone)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_ends_the_step_then_interrupts_and_the_engine_keeps_working(checkpoint, default_sigint):
    path = checkpoint("gqa2-untied", dtype="float32")
    with tp_llm(path, max_model_len=4096, kv_cache_memory=16 << 20, **EAGER) as llm:
        timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate([PROMPTS[2]] * 4, SamplingParams(max_tokens=4000, ignore_eos=True),
                             use_tqdm=False)
        finally:
            timer.cancel()
        # aborted, group intact
        assert llm.llm_engine.tp_group.dead is None and not llm.llm_engine.requests
        expected = [o.token_ids
                    for o in make_llm(path, **EAGER).generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)] == expected


# Loaded by the workers' interpreters only (they start after PYTHONPATH points here): fail where
# told to.
FAULT_HOOK = """
import os
import torch

where = os.environ.get("NANOQWEN_TEST_FAIL")
if where == "step":
    import nanoqwen.worker.model_runner as mr

    run_model, calls = mr.ModelRunner.run_model, [0]

    def failing(self, step):
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("simulated: out of memory in step 3")
        return run_model(self, step)

    mr.ModelRunner.run_model = failing
elif where == "load":
    import nanoqwen.worker.loading

    def failing_load(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated: out of memory while loading")

    nanoqwen.worker.loading.load_model = failing_load  # (what a rank loads its shard with)
"""


def test_failing_worker_stops_the_engine_with_its_error(checkpoint, tmp_path, monkeypatch):
    path = checkpoint("gqa2-untied", dtype="float32")
    (tmp_path / "sitecustomize.py").write_text(FAULT_HOOK)
    pythonpath = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", pythonpath)
    monkeypatch.setenv("NANOQWEN_TEST_FAIL", "step")
    llm = make_llm(path, tensor_parallel_size=2, **EAGER)
    with pytest.raises(EngineDeadError,
                       match=r"tensor-parallel worker 1 \(pid \d+\) exited with code 1: "
                             r"OutOfMemoryError: simulated: out of memory in step 3; "
                             r"the tensor-parallel group is stopped"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not dist.is_initialized()

    monkeypatch.setenv("NANOQWEN_TEST_FAIL", "load")
    with pytest.raises(EngineDeadError,
                       match=r"worker 1 \(pid \d+\) exited with code 1: OutOfMemoryError: "
                             r"simulated: out of memory while loading"):
        make_llm(path, tensor_parallel_size=2, **EAGER)
    assert not dist.is_initialized()


# ---------------------------------------------------------------- the server and torchrun


@contextlib.contextmanager
def tp2_server(path, log) -> Iterator[tuple[subprocess.Popen, str]]:
    """A `nanoqwen serve --tensor-parallel-size 2` process and its base URL; killed on the way out
    if still up."""
    proc, base = start_server(path, log)
    try:
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def assert_logged_worker_kill(log, pid: int) -> None:
    assert re.search(rf"nanoqwen: error: tensor-parallel worker 1 \(pid {pid}\) "
                     r"was killed by SIGKILL", log.read_text())


def start_server(path, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "nanoqwen", "serve", "--model", str(path), "--port", str(port),
           "--dtype", "float32", "--device", "cpu", "--max-model-len", "1024",
           "--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
           "--tensor-parallel-size", "2", "--enforce-eager"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not start:\n{log.read_text()}")
        time.sleep(0.2)


def worker_pid(log) -> int:
    found = re.search(r"tensor-parallel worker 1 started \(pid (\d+)\)", log.read_text())
    return int(found.group(1))


def test_server_with_tp2_answers_like_tp1_and_exits_when_a_worker_dies(checkpoint, tmp_path):
    path, log = checkpoint("tiny", dtype="float32"), tmp_path / "server.log"
    with tp2_server(path, log) as (proc, base):
        messages = [{"role": "user", "content": "Why is the sky blue?"}]
        greedy = SamplingParams(temperature=0, max_tokens=12)
        ref = make_llm(path, max_model_len=1024, **EAGER).chat(messages, greedy, use_tqdm=False)[0]
        body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == ref.text

# A worker dies in the middle of a stream: the stream ends with the error, the server exits
        # with it.
        pid = worker_pid(log)
        body = {"prompt": "Count to a thousand", "max_tokens": 1000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            # a few tokens in (events and the blank lines between them)
            first = [next(lines) for _ in range(6)]
            assert sum(line.startswith("data: {") for line in first) >= 2, first
            os.kill(pid, signal.SIGKILL)
            rest = "\n".join(lines)
        assert re.search(r'data: \{"error": \{"message": "the engine stopped: '
                         r'tensor-parallel worker 1 \(pid \d+\) '
                         r'was killed by SIGKILL; the tensor-parallel group is stopped"', rest)
        assert proc.wait(timeout=120) == 1
        assert_logged_worker_kill(log, pid)


def test_idle_server_exits_when_a_worker_dies(checkpoint, tmp_path):
    log = tmp_path / "server.log"
    with tp2_server(checkpoint("tiny", dtype="float32"), log) as (proc, _):
        pid = worker_pid(log)
        os.kill(pid, signal.SIGKILL)
        # no request needed to notice: the server exits by itself
        assert proc.wait(timeout=120) == 1
        assert_logged_worker_kill(log, pid)


def test_torchrun_two_ranks_generate_like_tp1(checkpoint):
    path = checkpoint("gqa2-untied", dtype="float32")
    args = ["generate", "--model", str(path), "--prompt", "Hello, my name is", "--no-chat-template",
            "--max-tokens", "10", "--temperature", "0", "--dtype", "float32", "--device", "cpu",
            "--max-model-len", "64", "--enforce-eager"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "nanoqwen", *args, "--tensor-parallel-size", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    greedy = SamplingParams(temperature=0, max_tokens=10)
    ref = make_llm(path, max_model_len=64, **EAGER).generate("Hello, my name is", greedy,
                                                             use_tqdm=False)[0]
    assert result.stdout == ref.text + "\n"  # printed once: by rank 0


@pytest.mark.parametrize("case", ["gqa2-untied", "moe-per-expert"])
def test_tp2_with_int8_quantises_each_rank_shard(case_dir, case):
    """quantization="int8" under TP: every rank quantises its own shard (the row-parallel
    projections' scales are per row of the rank's columns, so results are close to TP=1 int8, not
    bit-equal); MoE experts too."""
    from nanoqwen.quantization import Int8Experts, Int8Linear

    path = case_dir(case)

    ref = make_llm(path, quantization="int8", **EAGER)
    expected = ref.generate(PROMPTS, GREEDY, use_tqdm=False)
    with tp_llm(path, quantization="int8", **EAGER) as llm:
        model = llm.llm_engine.model
        assert (isinstance(model.layers[0].self_attn.o_proj, Int8Linear)
                and isinstance(model.lm_head, Int8Linear))
        if case.startswith("moe"):
            assert isinstance(model.layers[0].mlp.experts, Int8Experts)
# both ranks quantised: each holds about half of TP=1's int8 bytes (an unquantised fp32
        # shard: ~2x)
        assert len(llm.llm_engine.rank_weight_bytes) == 2
        for rank_bytes in llm.llm_engine.rank_weight_bytes:
            assert 0.45 < rank_bytes / ref.llm_engine.weight_bytes < 0.6
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    firsts = [(a.logprobs[0][a.token_ids[0]].logprob, b.logprobs[0][b.token_ids[0]].logprob)
              for a, b in zip(got, expected, strict=True) if a.token_ids[0] == b.token_ids[0]]
    assert len(firsts) >= 4
    for a, b in firsts:
        assert a == pytest.approx(b, abs=0.03)
