"""Speculative decoding: tokens proposed for a decoding sequence, verified by the target model in one step.

A sequence whose last token is not yet computed decodes one token a step. With proposals d_1..d_k its chunk is
[last, d_1, ..., d_k] at positions n-1 .. n-1+k, and the step keeps logits for all k + 1 rows (SeqChunk.draft = k).
Greedy verification: the target's choices t_0..t_k are the rows' argmaxes; d_i is accepted while d_i == t_{i-1},
and the first target choice after the accepted proposals is appended too (a correction, or a bonus token when all
k are accepted). So a step appends 1 to k + 1 tokens, the same tokens the target alone would have given one a
step. Sampled requests: rejection sampling (Sampler.verify), which keeps the target's distribution exactly: d_i is
accepted with probability p_i(d_i), a rejected one replaced by a draw from p_i without it.

Invariant: after the step the sequence's first num_computed_tokens tokens are in the cache: the last token and
the accepted proposals were computed with their true context; the rejected proposals' entries sit past
num_computed_tokens in blocks the sequence holds, never read (attention reads a sequence's first context_len
positions), and overwritten when those positions are computed. Blocks are never rolled back: they serve the
sequence's next tokens, and go back to the pool with it.

Which requests speculate (drafts_allowed): those whose sampling reads nothing but the logits, through temperature,
top-k and top-p (no logprobs, penalties, logit bias, min_tokens, min_p, grammar). The others decode one token a step
in the same batches. Not for models with recurrent state (linear attention): a rejected
proposal would have stepped the state.

Where proposals come from (Proposer, --speculative-config's method): "ngram", prompt lookup in the sequence's own
tokens; "draft_model", the greedy tokens of a smaller model on rank 0 (engine/draft_model.py); "mtp", the greedy
tokens of a DeepSeek checkpoint's multi-token-prediction layer on rank 0, fed the target's hidden states
(engine/mtp.py).

When it does not pay a request stops proposing (stops_paying): a verified step costs about 1 + c k single-token
steps, so proposals pay while the tokens a step adds, (1 - a^(k+1)) / (1 - a) at acceptance a, exceed that; once a
request has proposed MIN_PROPOSED tokens at an acceptance below that break-even, it decodes one token a step. A
draft model's k passes a step add their cost to c (its weights over the target's: DraftPlan.cost).
"""

from __future__ import annotations

import torch

from shardserve.config import SpeculativeConfig
from shardserve.engine.sequence import Sequence
from shardserve.requests.sampling_params import SamplingParams


def drafts_allowed(params: SamplingParams) -> bool:
    """Whether a request's tokens depend on the target's logits alone, through temperature, top-k and top-p (so
    its proposals can be verified row by row: Sampler.verify); see the module docstring."""
    return not params.processes_logits and params.logprobs is None


def ngram_proposals(token_ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup: for n from max_n down to min_n, the latest earlier occurrence of the last n tokens, and up to k
    tokens that followed it (fewer where the sequence ends first); [] where none occurs."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = token_ids[length - n:]
        # The latest occurrence ending before the tail itself starts (so at least one token follows it).
        for start in range(length - n - 1, -1, -1):
            if token_ids[start:start + n] == tail:
                return token_ids[start + n:start + n + k]
    return []


class Proposer:
    """Where a step's proposals come from: the Scheduler asks once a step, for all its decoding sequences, before it
    plans their chunks. `proposals` keeps the requests that may speculate (drafts_allowed, still paying: stops_paying)
    and the room each has: never more than num_speculative_tokens, nor than its max_tokens and the context length
    leave after the token the step adds anyway. A method implements propose_all, for all of them at once; one that
    keeps something per sequence (a draft model's cache) gives it back in release, which the Scheduler calls when a
    sequence stops running (finished, aborted, preempted), and gives back everything in reset."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, break_even: float) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.break_even = break_even

    def proposals(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """Proposed tokens by seq id, for those of `seqs` (decoding sequences) that speculate and got any."""
        requests = []
        for seq in seqs:
            p = seq.params
            if not self.speculates(seq):
                continue
            room = min(self.config.num_speculative_tokens, p.max_tokens - seq.num_output_tokens - 1,
                       self.max_model_len - seq.num_tokens - 1)
            if room > 0:
                requests.append((seq, room))
        if not requests:
            return {}
        return {seq.seq_id: drafts for (seq, _), drafts in zip(requests, self.propose_all(requests)) if drafts}

    takes_hidden = False  # whether it reads the target's hidden states (MTP: engine/mtp.py), handed to observe

    def speculates(self, seq: Sequence) -> bool:
        """Whether the sequence may get proposals: drafts_allowed, and still paying (stops_paying)."""
        return drafts_allowed(seq.params) and not stops_paying(seq.spec_proposed, seq.spec_accepted, self.break_even)

    def propose_all(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each (sequence, room), up to room tokens proposed after its last one."""
        raise NotImplementedError

    def observe(self, step, seqs: dict[int, Sequence]) -> None:
        """A target step ran (a ModelRunner.HiddenStep, only where takes_hidden): keep what proposing reads of it."""

    def release(self, seq: Sequence) -> None:
        """The sequence stopped running: forget what is kept for it."""

    def reset(self) -> None:
        """The engine's KV cache was reset (sleep, a weight reload): forget every sequence."""

    def sleep(self, level: int) -> None:
        """The engine sleeps: a proposer that holds device memory (a draft model) gives it back too."""

    def wake(self, weights: bool, kv_cache: bool) -> None:
        """The engine wakes: take back what sleep gave back."""

    def close(self) -> None:
        """The engine shuts down."""


class NgramProposer(Proposer):
    def propose_all(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [self.propose(seq.token_ids, room) for seq, room in requests]

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(num_speculative_tokens, limit) proposals following token_ids."""
        k = min(self.config.num_speculative_tokens, limit)
        if k <= 0:
            return []
        return ngram_proposals(token_ids, k, self.config.prompt_lookup_max, self.config.prompt_lookup_min)


def accepted_tokens(drafts: list[int], targets: list[int]) -> list[int]:
    """Greedy verification: targets[i] is the target's choice after the chunk's row i (row 0: the last token).
    The accepted proposals, then the target's next choice."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return drafts[:accepted] + [targets[accepted]]


# c of a verified step's cost, 1 + c k single-token steps, by device type. CPU measured: SmolLM2-135M Q4_1 on a
# 2-core Xeon with every proposal rejected, output tok/s 25.4 -> 21.7 at k = 1 and -> 17.6 at k = 3 (batch 1; batch 8
# 106.6 -> 90.9 / 68.5): c = 0.15 to 0.17. CUDA measured (benchmarks/speculative_gpu.py, one H200, bf16, batch 1,
# every step in CUDA graphs): a Llama-3-8B target with a 1B-shaped draft (cost 0.187 a pass) at k = 3 costs 1.98
# steps at acceptance ~0 and 2.05 at 1, so c = 0.14 to 0.16 besides the draft; most of it is the host's turn
# between the draft's passes and the verification, not the extra rows (the weights are read once for a few rows).
VERIFY_COST = {"cpu": 0.16, "cuda": 0.15}
MIN_PROPOSED = 8  # proposed tokens of a request before its acceptance is judged


def break_even_acceptance(k: int, c: float) -> float:
    """The acceptance a at which k proposals a step add as many tokens a step, (1 - a^(k+1)) / (1 - a), as the step
    costs single-token steps, 1 + c k (bisection: the left side grows with a)."""
    low, high = 0.0, 1.0
    for _ in range(40):
        a = (low + high) / 2
        if sum(a ** i for i in range(k + 1)) < 1 + c * k:
            low = a
        else:
            high = a
    return (low + high) / 2


def break_even_for(config: SpeculativeConfig, device: torch.device, draft_cost: float = 0.0) -> float:
    """The break-even acceptance of config's k on `device`; draft_cost: what making a proposal costs, in target steps
    (a draft model's forward pass: DraftPlan.cost), added to c."""
    c = VERIFY_COST.get(device.type, VERIFY_COST["cuda"]) + draft_cost
    return break_even_acceptance(config.num_speculative_tokens, c)


def stops_paying(proposed: int, accepted: int, break_even: float) -> bool:
    """Whether a request that proposed `proposed` tokens and had `accepted` of them accepted should stop proposing."""
    return proposed >= MIN_PROPOSED and accepted < break_even * proposed

