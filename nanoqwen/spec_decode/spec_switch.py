"""Whether speculation pays, per sequence, measured as the engine runs.

A verification step costs more than a plain decode step: the proposer's time (a draft model runs
k forwards) and the k extra rows the target verifies. It pays only when it yields more tokens than
it costs, so for each speculating sequence the engine compares:

- its tokens per verification step (the drafts accepted, plus the target's own), over its last 8;
- a speculative step's cost in plain decode steps of the same batch size: the fastest of the last 8
  speculative steps (propose and verify) over the fastest of the last 8 plain ones (the fastest,
  since a step that compiles a new shape or shares the CPU takes far longer than it costs). While
  a batch size has no recent plain step, its next step runs without drafts to measure one (again
  after every 64 speculative steps: steps grow slower as the context grows).

A sequence whose drafts do not pay (judged after 4 verifications; after 3 if not one draft was
accepted) decodes without drafts for 32 tokens, then tries again; each failed retry doubles the
pause, up to 256 tokens. A retry costs the verifications that judge it and the draft model's
catching up on the tokens it paused for (a prompt chunk through the draft). A draft the model
agrees with keeps speculating; one it mostly rejects (another model's, or a quantised copy of a
network that rounding throws off) costs a few steps per pause.

Decisions follow measured times, so with a seed a speculating request's tokens can differ between
runs (their distribution does not: rejection_sampler.py); `disable_by_acceptance: false` turns the
switch off.
"""

from __future__ import annotations

from collections import defaultdict, deque

from nanoqwen.core.scheduler import ScheduledBatch
from nanoqwen.core.sequence import Sequence

WINDOW = 8  # the steps whose times (and a sequence's verifications) are compared
MIN_VERIFICATIONS = 4  # a sequence's drafts are judged after this many verifications,
MIN_ALL_REJECTED = 3  # or after this many in which every draft was rejected
FIRST_PAUSE, MAX_PAUSE = 32, 256  # tokens decoded without drafts before trying again
PLAIN_EVERY = 64  # speculative steps between two plain steps measured at a batch size


def _window() -> deque[float]:
    return deque(maxlen=WINDOW)


class SpecDecodeSwitch:
    def __init__(self) -> None:
        # seconds per decode step, by batch size (the decoding sequences in the step)
        self.spec_seconds: defaultdict[int, deque[float]] = defaultdict(_window)
        self.plain_seconds: defaultdict[int, deque[float]] = defaultdict(_window)
        self.spec_steps_since_plain: defaultdict[int, int] = defaultdict(int)
        self.num_pauses = 0

    def record_step(self, batch: ScheduledBatch, propose_seconds: float,
                    execute_seconds: float) -> None:
        """The time a decode step took (a step with prompt chunks is not comparable)."""
        if batch.prefill:
            return
        batch_size = len(batch.decode) + len(batch.spec_decode)
        if any(s.seq.spec_token_ids for s in batch.spec_decode):
            self.spec_seconds[batch_size].append(propose_seconds + execute_seconds)
            self.spec_steps_since_plain[batch_size] += 1
        else:  # no drafts (none scheduled, or the n-gram lookup found none): a plain step
            self.plain_seconds[batch_size].append(execute_seconds)
            self.spec_steps_since_plain[batch_size] = 0

    def step_cost(self, batch_size: int) -> float | None:
        """A speculative step's time in plain decode steps at this batch size; None until both
        have run."""
        spec, plain = self.spec_seconds.get(batch_size), self.plain_seconds.get(batch_size)
        if not spec or not plain:
            return None
        return min(spec) / min(plain)

    def judge(self, seq: Sequence, num_new_tokens: int, batch_size: int) -> bool:
        """After a verification of seq's drafts that gave num_new_tokens: pause its speculation
        if its recent tokens per step are fewer than a step costs; whether it paused."""
        recent = seq.spec_recent_lengths
        recent.append(num_new_tokens)
        del recent[:-WINDOW]
        num_output_tokens = len(seq.output_token_ids) + num_new_tokens  # after this step
        cost = self.step_cost(batch_size)
        if cost is None or self.spec_steps_since_plain[batch_size] >= PLAIN_EVERY:
            seq.spec_resume_at = num_output_tokens + 1  # its next step plain, to measure one
            return False
        hopeless = len(recent) >= MIN_ALL_REJECTED and max(recent) == 1
        if len(recent) < MIN_VERIFICATIONS and not hopeless:
            return False
        if sum(recent) / len(recent) >= cost:
            seq.spec_pause = 0  # it pays: a later pause starts short again
            return False
        pause = seq.spec_pause or FIRST_PAUSE
        seq.spec_resume_at = num_output_tokens + pause
        seq.spec_pause = min(2 * pause, MAX_PAUSE)
        recent.clear()  # a retry is judged on its own verifications
        self.num_pauses += 1
        return True
