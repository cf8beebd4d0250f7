"""Scheduler on its own, with a real BlockManager and hand-made sequences (no model).

`run_step` does the engine's part between two schedule() calls: the scheduled tokens are now in the
cache, full blocks are offered to the prefix cache, and a sequence whose tokens are all computed
samples one new token.
"""

from __future__ import annotations

import pytest

from nanoqwen.core.block_manager import BlockManager
from nanoqwen.core.scheduler import ScheduledBatch, Scheduler
from nanoqwen.core.sequence import Sequence, SequenceStatus
from nanoqwen.sampling_params import SamplingParams

BS = 4  # block size
RUNNING, WAITING, FINISHED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.FINISHED


def make_scheduler(num_blocks: int = 32, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                   enable_prefix_caching: bool = True) -> Scheduler:
    bm = BlockManager(num_blocks, BS, enable_prefix_caching)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens)


def make_seq(num_tokens: int, first: int = 0, request_id: str = "r", index: int = 0) -> Sequence:
    return Sequence(request_id, index, list(range(first, first + num_tokens)), SamplingParams())


def run_step(sched: Scheduler, batch: ScheduledBatch, token: int = 1) -> None:
    """The engine's bookkeeping after running `batch` (ModelRunner.execute, LLMEngine.step)."""
    for seq in batch.decode:
        seq.num_computed_tokens += 1
    for seq, n in batch.prefill:
        seq.num_computed_tokens += n
    for seq in batch.decode + [s for s, _ in batch.prefill]:
        assert seq.status == RUNNING
        assert len(seq.block_table) * BS >= seq.num_computed_tokens  # the scheduler gave it blocks
        sched.block_manager.register_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:  # prompt done (or a decode step): it samples
            seq.output_token_ids.append(token)


def test_nothing_to_schedule_is_an_empty_batch():
    sched = make_scheduler()
    batch = sched.schedule()
    assert batch.empty and batch.num_tokens == 0 and not sched.has_unfinished()
    sched.add(make_seq(3))
    assert sched.has_unfinished() and not sched.schedule().empty


def test_decoding_sequences_get_one_token_each():
    sched = make_scheduler()
    seqs = [make_seq(n, first=100 * i) for i, n in enumerate([5, 3, 7])]
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()
    assert batch.decode == [] and batch.prefill == [(seq, seq.num_tokens) for seq in seqs]
    assert all(seq.status == RUNNING for seq in seqs)
    assert not sched.waiting and sched.running == seqs
    run_step(sched, batch)
    for step in range(3):
        batch = sched.schedule()
        assert batch.prefill == [] and set(batch.decode) == set(seqs) and len(batch.decode) == 3
        assert batch.num_tokens == 3
        run_step(sched, batch)
        assert [seq.num_computed_tokens for seq in seqs] == [n + step + 1 for n in (5, 3, 7)]


def test_the_token_budget_splits_a_long_prompt_over_steps():
    sched = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq(21)
    sched.add(seq)
    for start, chunk in ((0, 8), (8, 8), (16, 5)):
        batch = sched.schedule()
        assert batch.decode == [] and batch.prefill == [(seq, chunk)] and batch.num_tokens == chunk
        assert seq.num_computed_tokens == start
        # blocks for the tokens so far, not for the whole prompt
        assert len(seq.block_table) == -(-(start + chunk) // BS)
        run_step(sched, batch)
    assert seq.num_computed_tokens == 21 and len(seq.output_token_ids) == 1
    batch = sched.schedule()
    assert batch.decode == [seq] and batch.prefill == []


def test_a_chunked_prompt_never_stalls_decoding():
    """Decoding sequences take their token first; prompt chunks get the rest of the budget."""
    sched = make_scheduler(max_num_batched_tokens=8)
    a, b = make_seq(3), make_seq(20, first=100)
    sched.add(a)
    run_step(sched, sched.schedule())
    sched.add(b)
    for chunk in (7, 7, 6):
        batch = sched.schedule()
        assert batch.decode == [a] and batch.prefill == [(b, chunk)] and batch.num_tokens <= 8
        run_step(sched, batch)
    batch = sched.schedule()
    assert batch.decode == [a, b] and batch.prefill == []


def test_a_running_prompt_continues_before_new_ones_are_admitted():
    sched = make_scheduler(max_num_batched_tokens=8)
    a, b = make_seq(12), make_seq(4, first=100)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.prefill == [(a, 8)] and list(sched.waiting) == [b]  # the budget is spent on a
    run_step(sched, batch)
    batch = sched.schedule()
    assert batch.prefill == [(a, 4), (b, 4)] and not sched.waiting


def test_max_num_seqs_caps_admission():
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = make_seq(3), make_seq(3, first=10), make_seq(3, first=20)
    for seq in (a, b, c):
        sched.add(seq)
    batch = sched.schedule()
    assert batch.prefill == [(a, 3), (b, 3)] and list(sched.waiting) == [c] and c.block_table == []
    run_step(sched, batch)
    batch = sched.schedule()
    assert batch.decode == [a, b] and batch.prefill == [] and c.status == WAITING
    run_step(sched, batch)
    sched.finish(a)
    batch = sched.schedule()  # c's admission, alone
    assert batch.decode == [] and batch.prefill == [(c, 3)] and sched.running == [b, c]
    run_step(sched, batch)
    assert set(sched.schedule().decode) == {b, c}


def test_a_step_that_admits_runs_alone_and_decoding_waits_one_step_at_most():
    """A new request's first chunk does not wait for decode rows; the step after it decodes, even with more
    requests waiting (those join it)."""
    sched = make_scheduler()
    a = make_seq(3)
    sched.add(a)
    run_step(sched, sched.schedule())  # (its prompt: an admission alone)
    run_step(sched, sched.schedule())  # a decoding step
    steps = []
    for i in range(3):
        sched.add(make_seq(3, first=10 * (i + 1), request_id=f"new{i}"))
        batch = sched.schedule()
        steps.append((len(batch.decode), len(batch.prefill)))
        run_step(sched, batch)
    assert steps == [(0, 1), (2, 1), (0, 1)]  # alone; decoding with the next admission; alone again
    batch = sched.schedule()
    assert len(batch.decode) == 4 and batch.prefill == []


def test_a_cached_prefix_is_skipped_at_admission():
    sched = make_scheduler()
    a = make_seq(10)
    sched.add(a)
    run_step(sched, sched.schedule())  # a's 2 full blocks are cached
    b = Sequence("b", 0, list(range(8)) + [50, 51, 52], SamplingParams())
    sched.add(b)
    batch = sched.schedule()
    assert batch.decode == [a] and batch.prefill == [(b, 3)] and batch.num_tokens == 4
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and len(b.block_table) == 3
    run_step(sched, batch)
    assert b.num_computed_tokens == 11 and len(b.output_token_ids) == 1


def test_admission_waits_for_free_blocks_without_preempting():
    sched = make_scheduler(num_blocks=2)
    a, b = make_seq(7), make_seq(4, first=100)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.prefill == [(a, 7)] and list(sched.waiting) == [b]  # b needs a block; a holds both
    run_step(sched, batch)
    batch = sched.schedule()
    assert batch.decode == [a] and list(sched.waiting) == [b] and sched.num_preemptions == 0
    run_step(sched, batch)
    sched.finish(a)
    assert sched.schedule().prefill == [(b, 4)]


@pytest.mark.parametrize("prefix_caching,recomputed", [(False, 8), (True, 4)])
def test_when_blocks_run_out_the_newest_sequence_is_preempted_and_recomputed_later(
        prefix_caching, recomputed):
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=prefix_caching)
    bm = sched.block_manager
    a, b, c = make_seq(8), make_seq(7, first=100), make_seq(3, first=200)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.prefill == [(a, 8), (b, 7)] and bm.num_free_blocks == 0
    run_step(sched, batch)  # a: 9 tokens (needs a third block to decode), b: 8 tokens
    sched.add(c)

    batch = sched.schedule()
    assert batch.decode == [a] and batch.prefill == []  # a got b's block
    assert b.status == WAITING and sched.running == [a]
    assert list(sched.waiting) == [b, c]  # at the front of the queue
    assert b.block_table == [] and (b.num_computed_tokens, b.num_cached_tokens) == (0, 0)
    assert (b.num_preemptions, a.num_preemptions, sched.num_preemptions) == (1, 0, 1)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 1
    assert b.output_token_ids == [1]  # what it generated stays: it is recomputed, not restarted
    run_step(sched, batch)

    sched.finish(a)
    batch = sched.schedule()
    # b comes back first: its prompt and its token, less what the prefix cache still holds.
    assert batch.prefill == [(b, recomputed), (c, 3)]
    assert b.num_cached_tokens == 8 - recomputed and b.status == RUNNING
    run_step(sched, batch)
    assert b.num_computed_tokens == 8 and b.output_token_ids == [1, 1]


def test_a_newest_sequence_that_cannot_grow_preempts_itself():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    a, b = make_seq(7), make_seq(8, first=100)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())  # a: 8 tokens (its blocks have room), b: 9 (needs a block)
    batch = sched.schedule()
    assert batch.decode == [a] and batch.prefill == []
    assert b.status == WAITING and list(sched.waiting) == [b] and sched.running == [a]
    assert sched.num_preemptions == 1 and sched.block_manager.num_free_blocks == 2


def test_decode_rows_come_shortest_first():
    sched = make_scheduler()
    seqs = [make_seq(n, first=100 * i) for i, n in enumerate([9, 3, 6])]
    for seq in seqs:
        sched.add(seq)
    run_step(sched, sched.schedule())
    batch = sched.schedule()
    assert sched.running == seqs  # admission order
    assert batch.decode == [seqs[1], seqs[2], seqs[0]]


def test_finish_frees_the_blocks_of_a_running_or_waiting_sequence():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    bm = sched.block_manager
    a, b = make_seq(6), make_seq(6, first=100)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())
    assert sched.running == [a] and list(sched.waiting) == [b] and bm.num_free_blocks == 6
    sched.finish(b)  # waiting (an abort before admission)
    assert b.status == FINISHED and not sched.waiting and bm.num_free_blocks == 6
    sched.finish(a)  # running
    assert a.status == FINISHED and a.block_table == [] and not sched.running
    assert bm.num_free_blocks == 8 and not sched.has_unfinished()
    assert sched.schedule().empty


def test_finish_of_a_fork_pending_sibling_touches_no_queue():
    sched = make_scheduler()
    parent, sibling = make_seq(5), make_seq(5, index=1)
    sibling.status = SequenceStatus.FORK_PENDING
    sched.add(parent)
    sched.schedule()
    sched.finish(sibling)
    assert sibling.status == FINISHED and sched.running == [parent] and not sched.waiting


def test_start_forked_sibling_joins_the_running_sequences():
    sched = make_scheduler(num_blocks=8)
    bm = sched.block_manager
    parent, child = make_seq(10), make_seq(10, index=1)
    child.status = SequenceStatus.FORK_PENDING
    sched.add(parent)
    run_step(sched, sched.schedule())
    child.output_token_ids.append(2)  # sampled from the parent's last prompt row
    copies = []
    assert bm.fork(parent, child, lambda src, dst: copies.append((src, dst)))
    sched.start_forked(child)
    assert child.status == RUNNING and sched.running == [parent, child] and len(copies) == 1
    batch = sched.schedule()
    assert batch.decode == [parent, child] and batch.prefill == [] and batch.num_tokens == 2
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]
    run_step(sched, batch)
    assert child.num_computed_tokens == parent.num_computed_tokens == 11
    sched.finish(parent)
    sched.finish(child)
    assert bm.num_free_blocks == 8 and not sched.has_unfinished()


def test_a_step_that_preempts_admits_nothing():
    """The sequence just preempted is first in the queue: readmitting it in the same step would only
    preempt it again (blocks are short), so a step that preempts admits no one."""
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=5)
    a, b = make_seq(8), make_seq(9, first=100)
    sched.add(a)
    sched.add(b)
    preempting_steps = 0
    for _ in range(8):
        before = sched.num_preemptions
        batch = sched.schedule()
        if sched.num_preemptions > before:
            preempting_steps += 1
            assert batch.prefill == [], "a step that preempted admitted a sequence"
        if batch.empty:
            break
        run_step(sched, batch)
    assert preempting_steps >= 1  # the scenario does preempt (else this test proves nothing)


def test_the_step_after_a_preemption_admits_only_after_the_running_ones():
    """The sequence just preempted, first in the queue, is not admitted alone in the next step (ahead of the
    running ones' next slots, to be preempted again): that step decodes first."""
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=4)
    for seq in (make_seq(5), make_seq(2, first=100), make_seq(5, first=200)):
        sched.add(seq)
    preemptions, after_preempting = 0, False
    for _ in range(40):
        before, waiting = sched.num_preemptions, set(map(id, sched.waiting))
        batch = sched.schedule()
        admitted = [p.seq for p in batch.prefill if id(p.seq) in waiting]
        if after_preempting:
            assert not admitted or batch.decode, "the step after a preemption admitted alone"
        after_preempting = sched.num_preemptions > before
        preemptions += after_preempting
        if batch.empty:
            break
        run_step(sched, batch)
    assert preemptions >= 1


def test_one_requests_answers_take_turns_past_max_seqs_per_request_step():
    """A request's decoding sequences beyond the cap sit a step out, fewest tokens first; another
    request's sequence decodes every step."""
    bm = BlockManager(64, BS, True)
    sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=64, max_seqs_per_request_step=2)
    siblings = [make_seq(3, first=10 * i, request_id="many", index=i) for i in range(5)]
    other = make_seq(3, first=100, request_id="other")
    for seq in [*siblings, other]:
        sched.add(seq)
    run_step(sched, sched.schedule())  # the prompts (prompt chunks are never held back)
    turns = []
    for _ in range(5):
        batch = sched.schedule()
        assert other in batch.decode and len(batch.decode) == 3
        turns.append(sorted(s.index for s in batch.decode if s.request_id == "many"))
        run_step(sched, batch)
    assert turns == [[0, 1], [2, 3], [0, 4], [1, 2], [3, 4]]
    assert [len(s.output_token_ids) for s in siblings] == [3, 3, 3, 3, 3] and len(other.output_token_ids) == 6
