"""Turns rank 0's logits into next tokens: logits processing, greedy, temperature, min-p, top-k, top-p, seeds
and logprobs.

All the work happens on the logits' own device, batched over the rows; only the chosen token ids
(one host transfer) and, when some row asks for logprobs, their values (one more) reach the host.

Semantics per row, as for one request alone:
- first the logits processing the row asks for, in this order: logit_bias is added; while fewer than
  min_tokens tokens are generated, the stop tokens (eos unless ignore_eos, and stop_token_ids) get -inf;
  the repetition penalty divides the positive logits of the tokens in the prompt or the output by p and
  multiplies the others by p; the frequency and presence penalties subtract frequency x count +
  presence x (count > 0), counting the output tokens only; last, the tokens a structured output's grammar
  does not allow get -inf (so nothing after can bring them back);
- greedy (temperature 0 or top_k 1): the argmax of the processed logits;
- otherwise the processed logits are divided by the temperature, min-p drops the tokens whose probability
  is below min_p x the row's highest, top-k keeps the logits >= the k-th largest, top-p keeps the smallest
  prefix of the sorted distribution whose mass reaches top_p (always at least the best token), and one token
  is drawn from what is left.
Reported logprobs are those of the model's own distribution, before all of this.

Invariant: a seeded row's draw depends only on its own generator (seeded from `params.seed`, kept
per sequence until `forget`) and its own logits, never on the other rows of the batch. Whether its
logits are themselves independent of the batch is the model's business, not the sampler's: on CPUs
under --dtype auto (float32 throughout, the same weights at every batch size) they differ at most in
the last float32 bits, which leaves greedy and seeded tokens the same in the tests; in bfloat16, and
on GPUs, kernels picked per batch size round differently, so a seeded or greedy request may take
another path in a batch than alone. Unseeded rows share one generator per device, seeded from the
engine seed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from shardserve import envs
from shardserve.engine.structured_output import AllowedTokens, apply_allowed
from shardserve.kernels.availability import use_triton
from shardserve.requests.outputs import TokenLogprob
from shardserve.requests.sampling_params import SamplingParams
from shardserve.transfers import on_device

logger = logging.getLogger(__name__)

FUSED_PENALTIES_ENV = envs.FUSED_PENALTIES.name  # "0": the dense penalties on GPUs too

# Rows drawn (and penalized, without the fused kernel) at once. A draw's temporaries (scaled logits, a top-p row's
# sorted values and int64 order, probabilities, running mass, noise) take about 36 bytes a logit, the dense
# penalties' about 25 (benchmarks/sampler_memory.py): 2.8 GB for 512 rows of a 152k vocabulary at once, 0.35 GB
# for 64. The planner reserves them for this many rows only.
DRAW_CHUNK_ROWS = 64

# Keeps every token when a row has no top-p cut: the mass before a token never exceeds 1 by this much.
_NO_TOP_P = 2.0


@dataclass(frozen=True)
class RowHistory:
    """What min_tokens and the penalties read of a row's sequence when it samples."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Tokens generated before this one: one more than output_token_ids holds while the previous token is still
    # on the device (a step queued ahead); that token is then tokens_in_flight[in_flight] (Sampler.enqueue).
    num_generated: int
    in_flight: int | None = None


class PendingSample:
    """Sampling results still on the device: `tokens` [n] (None for an empty batch) and, when some row asked
    for logprobs, the packed integer and float tensors `resolve` reads."""

    def __init__(self, params: list[SamplingParams], tokens: torch.Tensor | None) -> None:
        self.params = params
        self.tokens = tokens
        self.wanted: list[int] = []
        self.top_n = 0
        self.ints = self.floats = None  # with logprobs: the tokens then the top ids; the logprobs
        self.host_ints = self.host_floats = None
        self._ready: torch.cuda.Event | None = None

    def start_transfer(self) -> None:
        """Queue the copies to the host now, right behind the sampling kernels: a step queued after this one
        must not delay them (one transfer of integers, one of floats)."""
        ints = self.tokens if self.ints is None else self.ints
        if ints.device.type != "cuda":
            self.host_ints, self.host_floats = ints, self.floats
            return
        self.host_ints = ints.to("cpu", non_blocking=True)  # into pinned memory
        if self.floats is not None:
            self.host_floats = self.floats.to("cpu", non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def wait(self) -> None:
        if self._ready is not None:
            self._ready.synchronize()


class Sampler:
    def __init__(self, seed: int, eos_token_ids: Collection[int] = ()) -> None:
        self.seed = seed
        self.eos_token_ids = tuple(eos_token_ids)  # what min_tokens keeps from being sampled, unless ignore_eos
        self._default_generators: dict[torch.device, torch.Generator] = {}  # for unseeded rows, per device
        self._generators: dict[int, torch.Generator] = {}  # seq id -> its own seeded generator
        self._token_counts = TokenCounts()  # what the penalties read, kept on the device between steps

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
        self._token_counts.forget(seq_id)

    def sample(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams],
               histories: Sequence[RowHistory] | None = None, allowed: AllowedTokens | None = None,
               tokens_in_flight: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [n, vocab] on any device, in any float dtype, row i for seq_ids[i] with params[i] and, when
        some row has min_tokens or a penalty, histories[i]; `allowed`: the grammar masks of the constrained rows;
        `tokens_in_flight`: on the logits' device, the tokens that histories name by `in_flight`.

        Returns the n chosen token ids and, per row, its TokenLogprob or None (when not asked for).
        """
        return self.resolve(self.enqueue(logits, seq_ids, params, histories, allowed, tokens_in_flight))

    def enqueue(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams],
                histories: Sequence[RowHistory] | None = None, allowed: AllowedTokens | None = None,
                tokens_in_flight: torch.Tensor | None = None) -> "PendingSample":
        """Queue all the device work of `sample` without waiting for it; `resolve` brings the results to the
        host. Once this returns, `logits` may be overwritten (stream order): everything read from it has
        been queued, and the results live in tensors of their own."""
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(seq_ids) != len(params):
            raise ValueError(f"the sampler needs one logits row per sequence: got logits of shape "
                             f"{tuple(logits.shape)} for {len(seq_ids)} sequence ids and {len(params)} parameter sets")
        if not params:
            return PendingSample(params, None)
        tokens = _plain_greedy_tokens(logits, params, allowed)
        if tokens is not None:
            pending = PendingSample(params, tokens)
            pending.start_transfer()
            return pending
        owned = logits.dtype != torch.float32  # .float() below then makes a copy of our own
        logits = logits.float()  # the model's distribution: what logprobs report
        processed = logits
        if any(p.processes_logits for p in params):
            # Processed in place where nothing reads the unprocessed values afterwards: the caller's buffer is
            # never written, and logprobs need the model's own values.
            keep_raw = not owned or any(p.logprobs is not None for p in params)
            processed = self._processed(logits.clone() if keep_raw else logits, seq_ids, params, histories, allowed,
                                        tokens_in_flight)
        tokens = processed.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        for start in range(0, len(sampled), DRAW_CHUNK_ROWS):
            chunk = sampled[start:start + DRAW_CHUNK_ROWS]
            rows = on_device(chunk, logits.device)
            drawn = self._draw(processed.index_select(0, rows), [seq_ids[i] for i in chunk],
                               [params[i] for i in chunk])
            tokens.index_copy_(0, rows, drawn)
        pending = PendingSample(params, tokens)
        pending.wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if pending.wanted:
            pending.top_n = max(params[i].logprobs for i in pending.wanted)
            chosen_lp, top_lp, top_ids = _logprobs(logits, tokens, pending.wanted, pending.top_n)
            pending.ints = torch.cat([tokens, top_ids.flatten()])
            pending.floats = torch.cat([chosen_lp.unsqueeze(1), top_lp], dim=1)
        pending.start_transfer()
        return pending

    @staticmethod
    def resolve(pending: "PendingSample") -> tuple[list[int], list[TokenLogprob | None]]:
        """The host side of `enqueue`: waits for the tokens (and logprobs) and returns them as lists."""
        params = pending.params
        if pending.tokens is None:
            return [], []
        pending.wait()
        if not pending.wanted:
            return pending.host_ints.tolist(), [None] * len(params)
        ints, floats, top_n = pending.host_ints.tolist(), pending.host_floats.tolist(), pending.top_n
        token_list, top_id_rows = ints[:len(params)], ints[len(params):]
        logprobs: list[TokenLogprob | None] = [None] * len(params)
        for row, i in enumerate(pending.wanted):
            n = params[i].logprobs
            ids = top_id_rows[row * top_n: row * top_n + n]
            logprobs[i] = TokenLogprob(token_list[i], floats[row][0], list(zip(ids, floats[row][1:1 + n])))
        return token_list, logprobs

    def _processed(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams],
                   histories: Sequence[RowHistory] | None, allowed: AllowedTokens | None,
                   tokens_in_flight: torch.Tensor | None) -> torch.Tensor:
        """Float32 `logits` [n, vocab], changed in place, with logit_bias, min_tokens, the penalties and the
        grammar masks applied to the rows that ask for them, each processor batched over its rows."""
        if histories is None and any(p.min_tokens > 0 or p.penalized for p in params):
            raise ValueError("min_tokens and the penalties need each row's history: pass `histories`")
        constrained = [r for r, p in enumerate(params) if p.structured is not None]
        if constrained != (allowed.rows if allowed is not None else []):
            raise ValueError("every row with a structured output, and only those, needs its grammar mask in `allowed`")
        _add_logit_bias(logits, params)
        _mask_stop_tokens(logits, params, histories, self.eos_token_ids)
        _apply_penalties(logits, seq_ids, params, histories, self._token_counts, tokens_in_flight)
        if allowed is not None:
            apply_allowed(logits, allowed)
        return logits

    def _draw(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams]) -> torch.Tensor:
        """One token per row of float32 `logits` [m, vocab] (all rows non-greedy), on their device."""
        return self._race(target_probs(logits, params), seq_ids, params)

    def _noise(self, shape: tuple[int, ...], seq_ids: list[int], params: list[SamplingParams], device,
               kind: str = "exponential") -> torch.Tensor:
        """Per row, `kind` noise (Exp(1) or U(0, 1)) over the last dim, a seeded row's from its own generator in
        order (so its draws ignore the other rows), the others from the sampler's default one."""
        noise = torch.empty(shape, device=device)
        draw = (lambda t, g: t.exponential_(generator=g)) if kind == "exponential" else \
            (lambda t, g: t.uniform_(generator=g))
        if any(p.seed is None for p in params):
            draw(noise, self._default_generator(device))
        for r, (seq_id, p) in enumerate(zip(seq_ids, params)):
            if p.seed is not None:
                draw(noise[r], self._seeded_generator(seq_id, p.seed, device))
        return noise

    def _race(self, probs: torch.Tensor, seq_ids: list[int], params: list[SamplingParams]) -> torch.Tensor:
        """One token per row of `probs` [m, vocab] (changed in place)."""
        # Exponential race (what torch.multinomial does for one sample, without its host syncs):
        # argmax(p / q) with q ~ Exp(1) picks token t with probability p_t. Each seeded row draws
        # its noise from its own generator, in token order, so its draw ignores the other rows.
        noise = self._noise(tuple(probs.shape), seq_ids, params, probs.device)
        # A zero draw would turn 0/0 into NaN, which argmax would pick.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return probs.div_(noise).argmax(dim=-1)

    def verify(self, logits: torch.Tensor, seqs: list[tuple[int, SamplingParams, list[int]]]) -> list[list[int]]:
        """Speculative verification (engine/speculative.py): `logits` holds, for each (seq id, params, proposals)
        in order, len(proposals) + 1 consecutive rows (after its last token, then after each proposal). Returns
        each sequence's tokens to append: the accepted proposals, then one token of the target's.

        Greedy rows (drafts_allowed: no other processing) take argmaxes (speculative.accepted_tokens). A sampled
        sequence keeps the target distribution exactly (rejection sampling with proposals of probability 1):
        proposal d_i is accepted with probability p_i(d_i); the first rejected one is replaced by a draw from p_i
        without d_i, renormalised; when all are accepted, a last token is drawn from the final row's p. p: the
        row's temperature, top-k and top-p distribution (target_probs), as `enqueue` draws from."""
        from shardserve.engine.speculative import accepted_tokens

        # Per row: its sequence, its params, and the proposal it verifies (-1 on a sequence's last row: none).
        row_seqs, row_params, row_proposals = [], [], []
        for seq_id, p, drafts in seqs:
            row_seqs += [seq_id] * (len(drafts) + 1)
            row_params += [p] * (len(drafts) + 1)
            row_proposals += [*drafts, -1]
        targets = logits.argmax(dim=-1).tolist()
        sampled = [r for r, p in enumerate(row_params) if not p.greedy]
        accepted, replacements = {}, {}
        if sampled:
            accepted, replacements = self._rejection_draws(logits, sampled, [row_seqs[r] for r in sampled],
                                                           [row_params[r] for r in sampled],
                                                           [row_proposals[r] for r in sampled])
        out, row = [], 0
        for _, p, drafts in seqs:
            if p.greedy:
                out.append(accepted_tokens(drafts, targets[row:row + len(drafts) + 1]))
            else:
                tokens = []
                for i, proposal in enumerate(drafts):
                    if not accepted[row + i]:
                        break
                    tokens.append(proposal)
                out.append(tokens + [replacements[row + len(tokens)]])
            row += len(drafts) + 1
        return out

    def _rejection_draws(self, logits: torch.Tensor, rows: list[int], seq_ids: list[int],
                         params: list[SamplingParams], proposals: list[int]) -> tuple[dict[int, bool], dict[int, int]]:
        """For these rows of `logits` (non-greedy), by row: whether the row's proposal is accepted (a U(0, 1) draw
        under p(proposal); never where the row has none, -1), and a replacement drawn from p without the proposal
        (from p itself where there is none). p: target_probs of the row."""
        device = logits.device
        probs = target_probs(logits.float().index_select(0, on_device(rows, device)), params)
        proposal = on_device(proposals, device, torch.long)
        has = proposal >= 0
        p_proposal = torch.where(has, probs.gather(1, proposal.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
        uniform = self._noise((len(rows),), seq_ids, params, device, "uniform")
        residual = probs.clone()
        residual[has] = residual[has].scatter(1, proposal[has].unsqueeze(1), 0.0)
        replacement = self._race(residual, seq_ids, params)
        accept, chosen = torch.stack([((uniform < p_proposal) & has).long(), replacement]).tolist()
        return dict(zip(rows, map(bool, accept))), dict(zip(rows, chosen))

    def _default_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._default_generators:
            self._default_generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._default_generators[device]

    def _seeded_generator(self, seq_id: int, seed: int, device: torch.device) -> torch.Generator:
        g = self._generators.get(seq_id)
        if g is None or g.device != device:
            g = self._generators[seq_id] = torch.Generator(device=device).manual_seed(seed)
        return g


def _plain_greedy_tokens(logits: torch.Tensor, params: list[SamplingParams],
                         allowed: AllowedTokens | None) -> torch.Tensor | None:
    """The tokens of a batch whose every row is greedy on the model's own logits (no logits processing, no grammar
    mask, no logprobs), read by the Triton argmax (kernels/triton/argmax.py) from `logits` as they are, without the
    float32 copy: the same tokens as the general path's argmax. None where the batch or the logits do not qualify."""
    plain = allowed is None and all(p.greedy and not p.processes_logits and p.logprobs is None for p in params)
    if not plain or not use_triton(logits):
        return None
    from shardserve.kernels.triton.argmax import DTYPES, greedy_tokens

    if logits.dtype not in DTYPES or logits.stride(1) != 1:
        return None
    return greedy_tokens(logits)


def _flat(tensor: torch.Tensor, rows: list[int], token_ids: list[int]) -> torch.Tensor:
    """The positions of (row, token) pairs in `tensor` [rows, vocab] seen as one flat vector, on its device.
    (index_add_/index_fill_ on a flat view cost a fraction of index_put_ with two index tensors.)"""
    vocab = tensor.shape[-1]
    return on_device([r * vocab + t for r, t in zip(rows, token_ids)], tensor.device)


def _add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows, token_ids, biases = [], [], []
    for r, p in enumerate(params):
        if p.logit_bias:
            bias = dict(p.logit_bias)  # a token listed twice takes its last value, as in a JSON object
            rows += [r] * len(bias)
            token_ids += bias.keys()
            biases += bias.values()
    if rows:
        # Each (row, token) pair appears once: one addition per logit, whatever order the device runs them in.
        logits.view(-1).index_add_(0, _flat(logits, rows, token_ids), on_device(biases, logits.device, torch.float32))


def _mask_stop_tokens(logits: torch.Tensor, params: list[SamplingParams],
                      histories: Sequence[RowHistory] | None, eos_token_ids: tuple[int, ...]) -> None:
    """-inf on the stop tokens of the rows that have generated fewer than min_tokens tokens."""
    vocab = logits.shape[-1]
    rows, token_ids = [], []
    for r, p in enumerate(params):
        if p.min_tokens > 0 and histories[r].num_generated < p.min_tokens:
            stops = [t for t in (*(() if p.ignore_eos else eos_token_ids), *p.stop_token_ids) if 0 <= t < vocab]
            rows += [r] * len(stops)
            token_ids += stops
    if rows:
        logits.view(-1).index_fill_(0, _flat(logits, rows, token_ids), float("-inf"))


def _apply_penalties(logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams],
                     histories: Sequence[RowHistory] | None, token_counts: "TokenCounts",
                     tokens_in_flight: torch.Tensor | None) -> None:
    """The repetition, frequency and presence penalties of the penalized rows, from the token counts kept on the
    device (TokenCounts): one fused pass on GPUs (kernels/triton/penalties.py, once it has matched the dense
    version below on this device), dense operations over the rows' vocabulary otherwise."""
    penalized = [r for r, p in enumerate(params) if p.penalized]
    if not penalized:
        return
    missing = [r for r in penalized if histories[r].num_generated != len(histories[r].output_token_ids)
               and (histories[r].in_flight is None or tokens_in_flight is None)]
    if missing:
        raise ValueError("a penalized row whose last token is still on the device needs it in tokens_in_flight")
    device = logits.device
    slots = token_counts.sync([seq_ids[r] for r in penalized], [histories[r] for r in penalized], device,
                              logits.shape[-1], tokens_in_flight)
    factors = on_device([[params[r].repetition_penalty, params[r].frequency_penalty, params[r].presence_penalty]
                         for r in penalized], device, torch.float32)
    rows = on_device(penalized, device)
    if fused_penalties_work(device):
        from shardserve.kernels.triton.penalties import apply_penalties

        apply_penalties(logits, rows, slots, token_counts.counts, token_counts.in_prompt, factors)
        return
    for start in range(0, len(penalized), DRAW_CHUNK_ROWS):  # a chunk's temporaries at a time, as draws
        part = slice(start, start + DRAW_CHUNK_ROWS)
        _dense_penalties(logits, rows[part], token_counts.counts.index_select(0, slots[part]),
                         token_counts.in_prompt.index_select(0, slots[part]), factors[part])


def _dense_penalties(logits: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor,
                     factors: torch.Tensor) -> None:
    repetition, frequency, presence = (f.unsqueeze(1) for f in factors.unbind(1))
    values = logits.index_select(0, rows)
    seen = counts > 0
    repeated = torch.where(values > 0, values / repetition, values * repetition)
    values = torch.where(seen | in_prompt, repeated, values)
    values -= counts * frequency + seen * presence
    logits.index_copy_(0, rows, values)


_fused_checked: dict[torch.device, bool] = {}


def fused_penalties_work(device: torch.device) -> bool:
    """Whether the fused penalties kernel runs here: CUDA with Triton, and its output on random inputs equal to
    the dense version's (checked once per device; a mismatch is logged and the dense version used)."""
    if device.type != "cuda" or not envs.FUSED_PENALTIES.get():
        return False
    if device not in _fused_checked:
        _fused_checked[device] = _check_fused_penalties(device)
    return _fused_checked[device]


def _check_fused_penalties(device: torch.device) -> bool:
    try:
        from shardserve.kernels.triton.penalties import apply_penalties
    except ImportError:
        return False
    g = torch.Generator(device="cpu").manual_seed(0)
    vocab, slots = 5003, 6  # a vocabulary that ends inside a block
    logits = (torch.randn(5, vocab, generator=g) * 4).to(device)
    counts = torch.randint(0, 3, (slots, vocab), generator=g).float().to(device)
    in_prompt = (torch.rand(slots, vocab, generator=g) < 0.1).to(device)
    rows, slot_ids = on_device([4, 0, 2], device), on_device([5, 1, 3], device)
    factors = on_device([[1.3, 0.5, 0.2], [0.8, -0.4, 1.5], [1.0, 0.0, -2.0]], device, torch.float32)
    fused, dense = logits.clone(), logits.clone()
    apply_penalties(fused, rows, slot_ids, counts, in_prompt, factors)
    _dense_penalties(dense, rows, counts.index_select(0, slot_ids), in_prompt.index_select(0, slot_ids), factors)
    error = (fused - dense).abs().max().item()
    if error > 1e-5:
        logger.error("the fused penalties kernel differs from the dense version by %.3g on %s: using the dense "
                     "version", error, device)
        return False
    return True


class TokenCounts:
    """Per penalized sequence, on the logits' device: how often each token occurs in its output (float32
    counts, exact below 2^24) and which tokens its prompt holds, one row of [slots, vocab] tensors per sequence.

    Each step adds only the tokens generated since the sequence last sampled (one, usually), and a sequence's
    prompt once, so a step costs the batch's new tokens, not its histories. Invariant: for a sequence with a
    slot, its row holds exactly the first `synced[seq_id]` output tokens and its whole prompt.
    """

    _FIRST_SLOTS = 64

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        self.slot_of: dict[int, int] = {}
        self.synced: dict[int, int] = {}  # seq id -> output tokens counted in its row
        self.free: list[int] = []

    def forget(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.synced.pop(seq_id, None)
            self.free.append(slot)

    def sync(self, seq_ids: list[int], histories: list[RowHistory], device: torch.device, vocab: int,
             tokens_in_flight: torch.Tensor | None = None) -> torch.Tensor:
        """The slots [r] (on `device`) of these sequences, their rows brought up to date with their histories:
        the output tokens on the host, and a token still on the device (RowHistory.in_flight), counted here
        from `tokens_in_flight`, and skipped when it reaches the host output at the next step."""
        # Slots in use are below len(slot_of) (freed ones are reused first): room for the sequences without one.
        self._fit(len(self.slot_of) + sum(seq_id not in self.slot_of for seq_id in seq_ids), device, vocab)
        fresh, slots, rows, tokens = [], [], [], []
        flight_slots, flight_index = [], []
        for seq_id, history in zip(seq_ids, histories):
            slot = self.slot_of.get(seq_id)
            done = self.synced.get(seq_id, 0)
            if slot is None or done > history.num_generated:  # new (or not the sequence it was)
                if slot is None:
                    slot = self.slot_of[seq_id] = self._take()
                fresh.append((slot, history.prompt_token_ids))
                done = 0
            new = history.output_token_ids[done:]
            rows += [slot] * len(new)
            tokens += new
            done += len(new)
            if history.in_flight is not None and done < history.num_generated:
                flight_slots.append(slot)
                flight_index.append(history.in_flight)
                done += 1
            self.synced[seq_id] = done
            slots.append(slot)
        if fresh:
            fresh_slots = on_device([slot for slot, _ in fresh], device)
            self.counts.index_fill_(0, fresh_slots, 0)
            self.in_prompt.index_fill_(0, fresh_slots, False)
            prompt_rows = [slot for slot, prompt in fresh for _ in prompt]
            prompt_tokens = [t for _, prompt in fresh for t in prompt]
            if prompt_tokens:
                self.in_prompt.view(-1).index_fill_(0, _flat(self.in_prompt, prompt_rows, prompt_tokens), True)
        # Whole numbers: the sums are exact whatever order the device adds repeated tokens in.
        if tokens:
            flat = _flat(self.counts, rows, tokens)
            self.counts.view(-1).index_add_(0, flat, torch.ones(len(tokens), dtype=torch.float32, device=device))
        if flight_slots:
            on_the_device = tokens_in_flight.index_select(0, on_device(flight_index, device))
            flat = on_device(flight_slots, device) * vocab + on_the_device
            self.counts.view(-1).index_add_(0, flat, torch.ones(len(flight_slots), dtype=torch.float32, device=device))
        return on_device(slots, device)

    def rows(self, seq_ids: list[int], histories: list[RowHistory], device: torch.device, vocab: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The counts [r, vocab] (float32) and prompt masks [r, vocab] (bool) of these sequences, brought up
        to date with their histories (all on the host)."""
        index = self.sync(seq_ids, histories, device, vocab)
        return self.counts.index_select(0, index), self.in_prompt.index_select(0, index)

    def _take(self) -> int:
        return self.free.pop() if self.free else len(self.slot_of)

    @classmethod
    def _slots_for(cls, sequences: int) -> int:
        """Slots held for `sequences`: a power of two, at least _FIRST_SLOTS."""
        return max(cls._FIRST_SLOTS, 1 << (max(sequences, 1) - 1).bit_length())

    @classmethod
    def peak_bytes(cls, max_num_seqs: int, vocab: int) -> int:
        """Device bytes at the most (for the memory planner): float32 counts and a bool a vocabulary entry for
        the slots of max_num_seqs sequences, plus the half as large pair they were copied from as they grew."""
        slots = cls._slots_for(max_num_seqs)
        held = slots + (slots // 2 if slots > cls._FIRST_SLOTS else 0)
        return held * vocab * (4 + 1)

    def _fit(self, slots_needed: int, device: torch.device, vocab: int) -> None:
        """Room for `slots_needed` slots (a power of two); the tensors move to `device` (and its vocabulary) if needed."""
        if self.counts is not None and (self.counts.device != device or self.counts.shape[1] != vocab):
            self.__init__()  # another device or vocabulary: nothing kept applies
        have = 0 if self.counts is None else self.counts.shape[0]
        if slots_needed <= have:
            return
        size = self._slots_for(slots_needed)
        counts = torch.zeros(size, vocab, dtype=torch.float32, device=device)
        in_prompt = torch.zeros(size, vocab, dtype=torch.bool, device=device)
        if self.counts is not None:
            counts[:have] = self.counts
            in_prompt[:have] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt


def _drop_below_min_p(scaled: torch.Tensor, params: list[SamplingParams]) -> None:
    """-inf on the tokens whose probability is below min_p x the row's highest, for temperature-scaled logits
    [m, vocab] already shifted so that each row's maximum is 0 (a token's probability over the highest is then
    exp(its scaled logit))."""
    log_min_p = on_device([math.log(p.min_p) if p.min_p > 0 else float("-inf") for p in params], scaled.device,
                          torch.float32)
    scaled.masked_fill_(scaled < log_min_p.unsqueeze(1), float("-inf"))


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row of float32 `logits` [m, vocab] draws from: softmax(logits / temperature) over the
    tokens min-p, top-k and top-p keep (all rows non-greedy)."""
    vocab = logits.shape[-1]
    device = logits.device
    temperature = on_device([p.temperature for p in params], device)
    # Shifting by the row maximum changes no probability and keeps a tiny temperature from overflowing.
    scaled = (logits - logits.amax(dim=-1, keepdim=True)).div_(temperature.unsqueeze(1))
    if any(p.min_p > 0 for p in params):
        _drop_below_min_p(scaled, params)
    # Rows with a top-p cut need a sort; rows with only a top-k cut need just their k-th largest
    # logit. Both keep exactly the tokens the semantics above keep, so which path a row takes
    # never changes its result.
    top_k_only = [r for r, p in enumerate(params) if 0 < p.top_k < vocab and p.top_p >= 1.0]
    if top_k_only:
        rows = on_device(top_k_only, device)
        scaled.index_copy_(0, rows, _top_k(scaled.index_select(0, rows), [params[r].top_k for r in top_k_only]))
    top_p = [r for r, p in enumerate(params) if p.top_p < 1.0]
    if top_p:
        rows = on_device(top_p, device)
        scaled.index_copy_(0, rows, _top_k_top_p(scaled.index_select(0, rows), [params[r] for r in top_p]))
    return torch.softmax(scaled, dim=-1)


def _top_k(scaled: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Temperature-scaled logits [c, vocab] with the logits below each row's k-th largest set to -inf."""
    k = on_device(ks, scaled.device)
    kth = torch.topk(scaled, max(ks), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    return scaled.masked_fill_(scaled < kth, float("-inf"))


def _top_k_top_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits [c, vocab] with the tokens top-k and top-p drop set to -inf.

    One stable sort of the rows (ties keep token order, so a row's result never depends on the
    others); rows without a top-k keep all vocab tokens, rows without a top-p keep all the mass.
    """
    c, vocab = scaled.shape
    device = scaled.device
    k = on_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device)
    top_p = on_device([p.top_p if p.top_p < 1.0 else _NO_TOP_P for p in params], device)
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
    kth = ordered.gather(1, (k - 1).unsqueeze(1))
    ordered.masked_fill_(ordered < kth, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    # Drop a token when the mass before it already reaches top_p: the best token always stays.
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    ordered.masked_fill_(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(ordered).scatter_(1, order, ordered)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, wanted: list[int], top_n: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the `wanted` rows: the chosen token's logprob [w], the top_n best logprobs [w, top_n] and
    their token ids [w, top_n], best first; all on the logits' device. Logprobs are those of the
    model's distribution (before logits processing, temperature, min-p, top-k and top-p)."""
    rows = on_device(wanted, logits.device)
    lp = torch.log_softmax(logits.index_select(0, rows), dim=-1)
    chosen = lp.gather(1, tokens.index_select(0, rows).unsqueeze(1)).squeeze(1)
    if top_n == 0:
        empty = lp.new_empty((len(wanted), 0))
        return chosen, empty, empty.long()
    top = torch.topk(lp, top_n, dim=-1)
    return chosen, top.values, top.indices
