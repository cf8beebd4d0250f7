"""Memory advised for 2 MiB pages (nanoqwen/ops/cpu/memory.py): a CPU engine's weights moved there
(nanoqwen/worker/huge_pages.py) with the same values, ties and outputs, and the paged KV cache allocated there, in
mappings the kernel may back with huge pages; NANOQWEN_HUGE_PAGES=0 leaves both in ordinary memory."""

from __future__ import annotations

import logging

import torch
from conftest import PROMPTS, make_llm, prompt_logits

from nanoqwen.attention import kv_cache
from nanoqwen.attention.kv_cache import KVCache
from nanoqwen.ops.cpu import memory
from nanoqwen.worker import huge_pages


def mapping_field(address: int, field: str) -> int:
    """A field of /proc/self/smaps (e.g. THPeligible: 1 where the kernel may use huge pages) for the mapping
    holding address."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= address < end
            elif inside and head == f"{field}:":
                return int(line.split()[1])
    raise AssertionError(f"no {field} for address {address:#x} in /proc/self/smaps")


def test_cpu_engine_moves_its_weights_into_huge_page_memory_unchanged(checkpoint, monkeypatch):
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 1)  # this tiny model's tensors are all small
    path = checkpoint("gqa1-tied-headdim")  # a tied head: the embedding and the head are one Parameter
    monkeypatch.setenv("NANOQWEN_HUGE_PAGES", "0")
    plain = make_llm(path).llm_engine.runner.model
    monkeypatch.delenv("NANOQWEN_HUGE_PAGES")
    moved = make_llm(path).llm_engine.runner.model

    assert moved.is_tied and moved.lm_head.weight.data_ptr() == moved.embed_tokens.weight.data_ptr()
    for (name, a), (_, b) in zip(plain.state_dict().items(), moved.state_dict().items(), strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride(), name
    assert torch.equal(prompt_logits(plain, PROMPTS[3]), prompt_logits(moved, PROMPTS[3]))

    weights = [p.data_ptr() for p in moved.parameters()]
    if memory.kernel_gives_huge_pages():
        assert all(mapping_field(w, "THPeligible") == 1 for w in weights)
        assert max(weights) - min(weights) < sum(p.nbytes + 64 for p in moved.parameters())  # one mapping
    # with NANOQWEN_HUGE_PAGES=0 nothing moved: each weight is where the loader's allocation put it (that mapping is
    # torch's and glibc's, not advised here; the kernel once reported one such THPeligible in a full run)
    assert not any(memory.in_huge_page_memory(p.untyped_storage()) for p in plain.parameters())


def test_huge_pages_off_leaves_the_weights_where_they_are(checkpoint, monkeypatch):
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 1)
    monkeypatch.setenv("NANOQWEN_HUGE_PAGES", "0")
    model = make_llm(checkpoint("gqa2-untied")).llm_engine.runner.model
    assert not any(memory.in_huge_page_memory(p.untyped_storage()) for p in model.parameters())
    where = [p.data_ptr() for p in model.parameters()]
    assert huge_pages.move_to_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == where
    monkeypatch.setattr(memory, "transparent_huge_pages", lambda: "never")  # a kernel without them
    monkeypatch.delenv("NANOQWEN_HUGE_PAGES")
    assert huge_pages.move_to_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == where


def test_a_table_over_the_size_limit_stays_and_nothing_moves_twice(checkpoint, monkeypatch):
    """A storage over MAX_BYTES is left where it is (its copy would raise the peak of memory by its size), and a
    model already moved (or a draft sharing its target's embedding) is not copied again."""
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 1)
    monkeypatch.setenv("NANOQWEN_HUGE_PAGES", "0")
    model = make_llm(checkpoint("gqa2-untied")).llm_engine.runner.model
    monkeypatch.delenv("NANOQWEN_HUGE_PAGES")
    table = model.embed_tokens.weight
    monkeypatch.setattr(huge_pages, "MAX_BYTES", table.nbytes - 1)
    where, values = table.data_ptr(), table.detach().clone()
    layer = model.layers[0].mlp.down_proj.weight
    layer_was = layer.data_ptr()
    moved = huge_pages.move_to_huge_pages(model)
    if not memory.kernel_gives_huge_pages():
        assert moved == 0
        return
    assert moved > 0 and table.data_ptr() == where and torch.equal(table, values)
    assert layer.data_ptr() != layer_was and memory.in_huge_page_memory(layer.untyped_storage())
    assert huge_pages.move_to_huge_pages(model) == 0  # already there


def test_cpu_kv_cache_is_zeros_in_huge_page_memory_unless_turned_off(monkeypatch):
    """The pool's keys, values and (quantized) scales are each a buffer advised for 2 MiB pages, zeros to start;
    with NANOQWEN_HUGE_PAGES=0, or a kernel without transparent huge pages, ordinary zeroed memory."""
    def pools(cache: KVCache) -> list[torch.Tensor]:
        return [cache.k, cache.v, cache.k_scale, cache.v_scale]

    monkeypatch.delenv("NANOQWEN_HUGE_PAGES", raising=False)  # (on by default)
    cache = KVCache(2, 1024, 16, 2, 64, torch.bfloat16, torch.device("cpu"), cache_dtype="int8")  # codes 4 MiB
    if memory.kernel_gives_huge_pages():
        for pool in pools(cache):
            assert memory.in_huge_page_memory(pool.untyped_storage())
            if pool.nbytes >= memory.HUGE_PAGE:  # (a mapping holding no whole 2 MiB page is never eligible)
                assert mapping_field(pool.data_ptr(), "THPeligible") == 1
    assert all(not pool.any() for pool in pools(cache))
    cache.store(1, torch.ones(3, 2, 64, dtype=torch.bfloat16), torch.ones(3, 2, 64, dtype=torch.bfloat16),
                torch.tensor([0, 17, 127]))
    assert cache.k[1].count_nonzero() == 3 * 2 * 64 and cache.v_scale[1].count_nonzero() == 3 * 2

    monkeypatch.setenv("NANOQWEN_HUGE_PAGES", "0")
    plain = KVCache(2, 8, 16, 2, 64, torch.bfloat16, torch.device("cpu"))
    assert plain.k_scale is None
    assert not any(memory.in_huge_page_memory(pool.untyped_storage()) for pool in (plain.k, plain.v))
    assert not plain.k.any() and not plain.v.any()
    monkeypatch.delenv("NANOQWEN_HUGE_PAGES")
    monkeypatch.setattr(memory, "transparent_huge_pages", lambda: "never")
    never = KVCache(2, 8, 16, 2, 64, torch.bfloat16, torch.device("cpu"))
    assert not memory.in_huge_page_memory(never.k.untyped_storage()) and not never.v.any()


def test_cpu_kv_cache_where_the_kernel_refuses_the_advice_is_ordinary_memory_and_says_so(monkeypatch, caplog):
    """A kernel built without transparent huge pages refuses MADV_HUGEPAGE (OSError): the pool is made in ordinary
    zeroed memory as with NANOQWEN_HUGE_PAGES=0, and a debug line says why."""
    def refuse(nbytes: int) -> torch.Tensor:
        raise OSError(22, "Invalid argument")

    monkeypatch.setenv("NANOQWEN_HUGE_PAGES", "1")
    monkeypatch.setattr(memory, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setattr(kv_cache, "huge_page_buffer", refuse)
    with caplog.at_level(logging.DEBUG, logger="nanoqwen"):
        cache = KVCache(2, 8, 16, 2, 64, torch.bfloat16, torch.device("cpu"), cache_dtype="int8")
    assert cache.k.shape == (2, 8, 16, 2, 64) and not cache.k.any() and not cache.v_scale.any()
    assert not memory.in_huge_page_memory(cache.k.untyped_storage())
    assert "KV cache stays in 4 KiB pages" in caplog.text and "Invalid argument" in caplog.text


def test_an_empty_cpu_kv_cache_pool_is_made_in_either_memory(monkeypatch):
    for setting in ("1", "0"):
        monkeypatch.setenv("NANOQWEN_HUGE_PAGES", setting)
        empty = KVCache(2, 0, 16, 2, 64, torch.bfloat16, torch.device("cpu"), cache_dtype="int8")
        assert empty.k.shape == (2, 0, 16, 2, 64) and empty.k_scale.shape == (2, 0, 16, 2)
