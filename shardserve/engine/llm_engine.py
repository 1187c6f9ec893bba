"""Rank 0's engine: owns the scheduler, sends each step plan to the other ranks, samples, detokenizes.

Ranks other than 0 run `run_worker`, which only replays the plans they receive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from shardserve import envs
from shardserve import heap
from shardserve.config import EngineConfig, ModelConfig
from shardserve.distributed.control_plane import ControlPlane
from shardserve.distributed.lockstep import LockstepCheck, default_every
from shardserve.distributed.process_group import RankContext
from shardserve.engine.block_manager import BlockManager
from shardserve.engine.draft_model import DraftModelProposer, DraftPlan
from shardserve.engine.model_runner import ModelRunner
from shardserve.engine.mtp import MtpProposer, check_mtp, mtp_plan
from shardserve.engine.sampler import PendingSample, RowHistory, Sampler
from shardserve.engine.scheduler import Scheduler
from shardserve.engine.sequence import Sequence, SequenceStatus
from shardserve.engine.speculative import MIN_PROPOSED, NgramProposer, Proposer, break_even_for
from shardserve.engine.structured_output import StructuredOutputs
from shardserve.kernels.plan import compute_dtype
from shardserve.requests.client import EngineStats
from shardserve.requests.detokenizer import IncrementalDetokenizer, detokenizer_for, text_update
from shardserve.requests.outputs import RequestOutput, TokenLogprob
from shardserve.requests.sampling_params import SamplingParams
from shardserve.transfers import on_device
from shardserve.wire.step_plan import WAKE_KV_CACHE, WAKE_WEIGHTS, PlanKind, StepPlan

if TYPE_CHECKING:
    from shardserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CANARY_ID = "shardserve-canary"


OVERLAP_ENV = envs.OVERLAP_STEPS.name


def overlap_steps_enabled(runner: ModelRunner, world_size: int) -> bool:
    """Overlapped decoding pays where the device runs ahead of the host (CUDA graphs), at any number of ranks
    (the runner then broadcasts rank 0's sampled tokens on the data plane before each step computed ahead: at
    TP=2 on two H200s, batch-1 decode took 2.96 ms a token with it and 4.18 without). Under pipeline stages too: rank
    0 is on the first stage, where the tokens are read, and receives the last stage's logits on the device, so a
    step queued ahead waits for them on the device, not on the host; the sends and receives of the stages pair in
    step order on every rank.
    SHARDSERVE_OVERLAP_STEPS=1 also forces it on CPUs, where it is correct but gains nothing;
    SHARDSERVE_OVERLAP_STEPS=0 turns it off."""
    forced = envs.OVERLAP_STEPS.get()
    if forced is not None:
        return forced == "1"
    return runner.graphs is not None


def prefix_caching_allowed(config: EngineConfig, model_config: ModelConfig) -> bool:
    """Whether KV blocks of a cached prefix may be reused. Never for a model with linear-attention layers: their
    state after a prefix is not kept with its blocks, and a prefix without it cannot be resumed."""
    if not config.enable_prefix_caching:
        return False
    spec = config.speculative_config
    if spec is not None and spec.method == "mtp":
        logger.info("prefix caching off: MTP proposals read the target's hidden states of every position, which a "
                    "cached prefix does not keep")
        return False
    if model_config.linear_attention_layers:
        logger.info("prefix caching off: %s has %d linear-attention layers, whose state after a prefix is not "
                    "cached", model_config.architecture, len(model_config.linear_attention_layers))
        return False
    return True


def check_speculative(config: EngineConfig, model_config: ModelConfig) -> None:
    """Refuse --speculative-config where verification would go wrong: a model with recurrent state (a rejected
    proposal would have stepped it); and method "mtp" where the checkpoint has no MTP layer shardserve serves."""
    if config.speculative_config is None:
        return
    if config.speculative_config.method == "mtp":
        check_mtp(config.model, model_config, config.pipeline_parallel_size)
    if model_config.linear_attention_layers:
        raise ValueError(f"--speculative-config: {model_config.architecture} has "
                         f"{len(model_config.linear_attention_layers)} linear-attention layers, whose per-sequence "
                         "state a rejected proposal would have stepped; speculative decoding serves models without "
                         "recurrent state only")


def _draft_plan(config: EngineConfig, model_config: ModelConfig) -> DraftPlan | None:
    """The draft model of method "draft_model", or the MTP layer of method "mtp", checked and sized before the target
    loads; None for other methods."""
    spec = config.speculative_config
    if spec is None or spec.method not in ("draft_model", "mtp"):
        return None
    plan = mtp_plan if spec.method == "mtp" else DraftPlan.for_engine
    return plan(config, model_config, compute_dtype(config, model_config), config.resolve_max_model_len(model_config))


@dataclass
class _InFlight:
    """A queued step: its plan, the sequences that sample, and their samples still on the device."""

    plan: StepPlan
    seqs: list[Sequence]
    pending: PendingSample | None
    # Verified chunks (speculative decoding): each sequence and its proposals, in row order, and the logits of
    # their rows (draft + 1 a sequence), which Sampler.verify reads.
    verify: list = field(default_factory=list)
    verified_logits: object = None


class LLMEngine:
    def __init__(self, config: EngineConfig, ctx: RankContext, tokenizer: Tokenizer) -> None:
        assert ctx.is_driver, "only rank 0 drives the engine"
        self.config = config
        self.model_config = ModelConfig.from_model_path(config.model)
        check_speculative(config, self.model_config)
        self.tokenizer = tokenizer
        self.control = ControlPlane.connect(ctx)
        draft = _draft_plan(config, self.model_config)
        self.runner = ModelRunner(config, self.model_config, ctx, kv_set_aside=draft.set_aside if draft else None)
        self.lockstep = LockstepCheck(ctx.control_group, ctx.rank, ctx.world_size, default_every(ctx.device))
        self.max_model_len = self.runner.max_model_len
        self.prefix_caching = prefix_caching_allowed(config, self.model_config)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, self.prefix_caching)
        self.proposer = self._proposer(draft)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   state_slots=bool(self.model_config.linear_attention_layers),
                                   proposer=self.proposer)
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self.sampler = Sampler(config.seed, self.eos_token_ids)
        self.grammars = StructuredOutputs(tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.seqs: dict[int, Sequence] = {}
        self.by_request: dict[str, Sequence] = {}
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._step_id = 0
        # Sleep/wake: requests that arrive while asleep wait here; the canary's greedy tokens, recorded
        # at the first sleep from the weights as loaded, must come out again after every wake.
        self.held: list[Sequence] = []
        self.canary_tokens: list[int] | None = None
        self.canary_reloads = 0
        self.sleeps = self.wakes = 0
        self.last_wake_seconds = 0.0
        self.wake_on_request = config.wake_on_request
        self._in_flight: _InFlight | None = None
        self._freed: list[int] = []  # sequences finished since the last plan went out (the ranks drop their tables)
        self.steps_overlapped = 0  # steps queued before the previous step's tokens reached the host
        self.overlap_steps = overlap_steps_enabled(self.runner, ctx.world_size) and self.proposer is None
        heap.freeze_startup_objects()

    def _proposer(self, draft: DraftPlan | None) -> Proposer | None:
        """The proposer of --speculative-config's method (a draft model loads here, on this rank's device), with
        the break-even acceptance under which a request stops proposing."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        break_even = break_even_for(spec, self.runner.device, draft.cost if draft else 0.0)
        logger.info("speculative decoding: %s, up to %d proposed tokens a step; a request that proposed %d tokens "
                    "stops proposing while under %.2f of them are accepted (the break-even on %s%s)", spec.method,
                    spec.num_speculative_tokens, MIN_PROPOSED, break_even, self.runner.device.type,
                    f", a draft pass costing {draft.cost:.2f} target steps" if draft else "")
        if draft is None:
            return NgramProposer(spec, self.max_model_len, break_even)
        cls = MtpProposer if spec.method == "mtp" else DraftModelProposer
        return cls(self.config, draft, self.runner.device, self.runner.dtype, self.max_model_len, break_even)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.by_request:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids, params)
        seq = Sequence(request_id, prompt_token_ids, params)
        if params.structured is not None:
            self.grammars.add(seq.seq_id, params.structured)  # before anything else holds it: may refuse
        self.seqs[seq.seq_id] = seq
        self.by_request[request_id] = seq
        self.detokenizers[seq.seq_id] = detokenizer_for(self.tokenizer, params)
        if self.is_sleeping:
            self.held.append(seq)
        else:
            self.scheduler.add(seq)

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: send at least one token")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens but this model's maximum context length is "
                             f"{self.max_model_len} tokens (--max-model-len), which must also leave room "
                             f"for at least one generated token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.by_request.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort")
        return self._output(seq, [], "", None)

    def has_work(self) -> bool:
        return self.busy or bool(self.held and (self.wake_on_request or not self.is_sleeping))

    # -- sleep / wake -----------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.runner.weights_asleep or self.runner.kv_asleep

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back, on every rank. Needs an idle engine (no request in flight)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.busy:
            raise RuntimeError("cannot sleep with requests in flight")
        if self.is_sleeping:
            return
        if self.canary_tokens is None:
            self.canary_tokens = self._run_canary()
        self._send_control(PlanKind.SLEEP, level)
        self.runner.sleep(level)
        if self.proposer is not None:
            self.proposer.sleep(level)
        self._reset_cache()
        self.sleeps += 1
        logger.info("asleep (level %d): weights %s, KV cache freed", level,
                    "in host memory" if level == 1 else "dropped")

    def wake_up(self, weights: bool = True, kv_cache: bool = True) -> None:
        """Take the device memory back (both parts by default). Once fully awake, the canary must give
        the tokens it gave before the first sleep, or the weights are reloaded from the checkpoint."""
        started = time.perf_counter()
        self._send_control(PlanKind.WAKE, (WAKE_WEIGHTS if weights else 0) | (WAKE_KV_CACHE if kv_cache else 0))
        self.runner.wake(weights, kv_cache)
        if self.proposer is not None:
            self.proposer.wake(weights, kv_cache)
        if self.is_sleeping:
            return
        self._check_canary()
        self.wakes += 1
        self.last_wake_seconds = time.perf_counter() - started
        held, self.held = self.held, []
        for seq in held:
            if not seq.is_finished:  # aborted while asleep: _finish took it out already; never schedule it
                self.scheduler.add(seq)
        logger.info("awake")

    def _check_canary(self) -> None:
        if self.canary_tokens is None:
            return
        got = self._run_canary()
        if got == self.canary_tokens:
            return
        self.canary_reloads += 1
        logger.error("canary after wake gave %s, expected %s: the weights changed while asleep; reloading them "
                     "from the checkpoint", got, self.canary_tokens)
        self._send_control(PlanKind.RELOAD, 0)
        self.runner.reload_weights()
        self._reset_cache()
        got = self._run_canary()
        if got != self.canary_tokens:
            raise RuntimeError(f"the canary still gives {got} instead of {self.canary_tokens} after reloading "
                               "the checkpoint: refusing to serve")
        logger.info("canary passes after reloading the weights")

    def _run_canary(self) -> list[int]:
        """Greedy tokens of a fixed prompt, computed alone (called only when nothing else is scheduled)."""
        prompt = [t % self.model_config.vocab_size for t in range(1, 9)]
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False)
        self.add_request(CANARY_ID, prompt, params)
        seq = self.by_request[CANARY_ID]
        while not seq.is_finished or self._in_flight is not None:
            self.step()
        tokens = list(seq.output_token_ids)
        self._reset_cache()
        return tokens

    def _reset_cache(self) -> None:
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size, self.prefix_caching)
        self.scheduler.blocks = self.block_manager
        if self.proposer is not None:
            self.proposer.reset()

    def _send_control(self, kind: PlanKind, arg: int) -> None:
        self._step_id += 1
        self._send(StepPlan(self._step_id, kind, arg=arg))

    def _send(self, plan: StepPlan) -> None:
        """Send a plan to the other ranks, with the sequences finished since the last one."""
        plan.freed_seq_ids, self._freed = self._freed, []
        self.control.send(plan)

    # -- stepping ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step and return its outputs.

        Overlapped steps: while a step runs on the device, the next one is queued before the host reads
        the tokens it samples (Scheduler.schedule_ahead: the sequences that sample decode on with their
        tokens taken on the device, prompts go on and waiting requests join as usual), so the device never
        waits for the host's bookkeeping between steps. The step queued ahead is `self._in_flight` between
        calls; its outputs are returned by the next call. No step is queued ahead of one that samples for a
        constrained sequence: its grammar must accept the token in flight on the host first. (Penalties count
        a token still in flight from the device: TokenCounts.)
        """
        if self.held and self.is_sleeping and self.wake_on_request:
            self.wake_up()
        if self._in_flight is None:
            plan = self.scheduler.schedule()
            if not plan.chunks:
                return []
            self._in_flight = self._launch(plan)
        current, self._in_flight = self._in_flight, None
        if self.overlap_steps and not any(s.params.needs_last_token for s in current.seqs):
            plan = self.scheduler.schedule_ahead(current.seqs, self.max_model_len)
            if plan is not None:
                self._in_flight = self._launch(plan, self._device_tokens(plan, current))
                self.steps_overlapped += 1
        outputs = self._resolve(current)
        if self._in_flight is not None and self._in_flight.plan.tokens_from_device:
            # The tokens it took from the device are now in their sequences: its chunks count as computed.
            self.scheduler.finish_step(self._in_flight.plan, self.seqs)
        return outputs

    @staticmethod
    def _device_tokens(plan: StepPlan, current: "_InFlight"):
        """The input tokens of `plan`'s FROM_DEVICE chunks, in chunk order, gathered on the device from the
        tokens `current` sampled; None for a plan that takes none."""
        n = plan.num_device_tokens
        if n == 0:
            return None
        tokens = current.pending.tokens
        ids = [c.seq_id for c in plan.chunks[:n]]
        if ids == [s.seq_id for s in current.seqs]:  # every sequence that sampled decodes on
            return tokens
        row = {s.seq_id: i for i, s in enumerate(current.seqs)}
        return tokens.index_select(0, on_device([row[i] for i in ids], tokens.device))

    def _launch(self, plan: StepPlan, device_tokens=None) -> "_InFlight":
        """Queue a step on the device, and its sampling; nothing here waits for the device."""
        self._send(plan)
        if self.proposer is not None and self.proposer.takes_hidden:  # MTP: the proposer keeps the hidden states
            step = self.runner.execute_hidden(plan)
            self.proposer.observe(step, self.seqs)
            seq_ids, logits = step.seq_ids, step.logits
        else:
            seq_ids, logits = self.runner.execute(plan, device_tokens)
        self.lockstep.confirm(plan)
        if not plan.tokens_from_device:  # one taking tokens from the device is finished once they arrive
            self.scheduler.finish_step(plan, self.seqs)
        if not seq_ids:
            return _InFlight(plan, [], None)
        verify, verified_logits = [], None
        if any(c.draft for c in plan.chunks):
            seq_ids, logits, verify, verified_logits = self._split_verified(plan, seq_ids, logits)
            if not seq_ids:
                return _InFlight(plan, [], None, verify, verified_logits)
        seqs = [self.seqs[i] for i in seq_ids]
        params = [s.params for s in seqs]
        histories = _histories(plan, seqs) if any(p.processes_logits for p in params) else None
        # The device computes the logits meanwhile: the grammar masks cost no device time where it runs ahead.
        allowed = self.grammars.allowed(seq_ids) if self.grammars.matchers else None
        return _InFlight(plan, seqs, self.sampler.enqueue(logits, seq_ids, params, histories, allowed, device_tokens),
                         verify, verified_logits)

    def _split_verified(self, plan: StepPlan, seq_ids: list[int], logits):
        """The rows of verified chunks (draft + 1 consecutive rows of one sequence) apart from the others: (the
        others' seq ids and logits, [(sequence, its proposals)] in row order, the verified rows' logits)."""
        drafted = {c.seq_id: c for c in plan.chunks if c.draft}
        rows, verified_rows, verify = [], [], []
        i = 0
        while i < len(seq_ids):
            chunk = drafted.get(seq_ids[i])
            if chunk is None:
                rows.append(i)
                i += 1
                continue
            verify.append((self.seqs[chunk.seq_id], chunk.token_ids[-chunk.draft:]))
            verified_rows.extend(range(i, i + chunk.draft + 1))
            i += chunk.draft + 1
        verified = logits[on_device(verified_rows, logits.device)]
        others = logits[on_device(rows, logits.device)] if rows else None
        return [seq_ids[r] for r in rows], others, verify, verified

    def _resolve(self, step: "_InFlight") -> list[RequestOutput]:
        """Wait for a step's tokens and append them; a sequence that finished or was aborted while the step
        was in flight drops its token (it was computed ahead, after the sequence's real last token)."""
        outputs = []
        if step.pending is not None:
            tokens, logprobs = self.sampler.resolve(step.pending)
            outputs = [self._append(seq, token, lp) for seq, token, lp in zip(step.seqs, tokens, logprobs)
                       if not seq.is_finished]
        if step.verify:
            outputs += self._resolve_verified(step)
        return outputs

    def _resolve_verified(self, step: "_InFlight") -> list[RequestOutput]:
        """Each verified sequence takes its accepted proposals and the target's next token (speculative.py); the
        accepted proposals' cache entries count as computed."""
        chosen = self.sampler.verify(step.verified_logits,
                                     [(seq.seq_id, seq.params, drafts) for seq, drafts in step.verify])
        outputs = []
        for (seq, drafts), tokens in zip(step.verify, chosen):
            if seq.is_finished:
                continue
            self.spec_drafts += 1
            self.spec_draft_tokens += len(drafts)
            self.spec_accepted_tokens += len(tokens) - 1
            seq.spec_proposed += len(drafts)
            seq.spec_accepted += len(tokens) - 1
            self.scheduler.accept_drafts(seq, len(tokens) - 1)
            outputs.append(self._append_all(seq, tokens))
        return outputs

    def _append_all(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        """_append for several tokens of one step, as one output; tokens after one that finishes the sequence are
        dropped."""
        out, new, delta = None, [], ""
        for token in tokens:
            out = self._append(seq, token, None)
            new.append(token)
            delta += out.delta_text
            if seq.is_finished:
                break
        return dataclasses.replace(out, new_token_ids=new, delta_text=delta)

    def stats(self) -> EngineStats:
        blocks = self.block_manager
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting) + len(self.held),
            kv_blocks_total=blocks.num_blocks, kv_blocks_free=blocks.num_free_blocks,
            preemptions=self.scheduler.num_preemptions, prefix_queries=blocks.prefix_queries,
            prefix_hits=blocks.prefix_hits, sleeping=self.is_sleeping, sleeps=self.sleeps, wakes=self.wakes,
            last_wake_seconds=self.last_wake_seconds, spec_drafts=self.spec_drafts,
            spec_draft_tokens=self.spec_draft_tokens, spec_accepted_tokens=self.spec_accepted_tokens)

    @property
    def busy(self) -> bool:
        """Requests are scheduled or a step is still in flight."""
        return self.scheduler.has_work() or self._in_flight is not None

    def keepalive(self) -> None:
        self._send_control(PlanKind.KEEPALIVE, 0)

    def shutdown(self) -> None:
        self._send_control(PlanKind.SHUTDOWN, 0)
        self.control.close()
        if self.proposer is not None:
            self.proposer.close()
        self.runner.close()
        heap.release_startup_objects(collect=self.runner.device.type == "cuda")

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        seq.append_token(token)
        p = seq.params
        reason = None
        # Before min_tokens the sampler masks the stop tokens; this check agrees with it.
        stops_allowed = seq.num_output_tokens > p.min_tokens
        if stops_allowed and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if p.structured is not None and self.grammars.accept(seq.seq_id, token):
            reason = "stop"  # the end-of-sequence token of a complete grammar (with ignore_eos too)
        delta, stopped = "", False  # without detokenize the text stays ""
        if p.detokenize:
            delta, stopped = text_update(self.detokenizers[seq.seq_id], seq.output_token_ids, reason)
        if stopped:
            reason = "stop"
        if reason is not None:
            self._finish(seq, reason)
        return self._output(seq, [token], delta, [logprob] if logprob is not None else None)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of every place that holds it (waiting, running, held while asleep); a step in
        flight that still names it drops its token (_resolve, Scheduler.finish_step)."""
        if seq in self.held:
            self.held.remove(seq)
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._freed.append(seq.seq_id)
        self.seqs.pop(seq.seq_id, None)
        self.by_request.pop(seq.request_id, None)
        self.sampler.forget(seq.seq_id)
        self.grammars.forget(seq.seq_id)

    def _output(self, seq: Sequence, new_ids: list[int], delta: str, logprobs) -> RequestOutput:
        detok = self.detokenizers[seq.seq_id]
        if seq.is_finished:
            self.detokenizers.pop(seq.seq_id, None)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, token_ids=seq.output_token_ids,
            text=detok.text, new_token_ids=new_ids, delta_text=delta, new_logprobs=logprobs,
            finished=seq.is_finished, finish_reason=seq.finish_reason,
        )


def _histories(plan: StepPlan, seqs: list[Sequence]) -> list[RowHistory]:
    """Per sampling sequence, what logits processing reads of it. A sequence whose input token is still on the
    device (a FROM_DEVICE chunk: the step was queued ahead) has generated one token more than it holds: the
    chunk's entry in the step's device tokens."""
    in_flight = {c.seq_id: i for i, c in enumerate(plan.chunks[:plan.num_device_tokens])}
    return [RowHistory(s.prompt_token_ids, s.output_token_ids, s.num_output_tokens + (s.seq_id in in_flight),
                       in_flight.get(s.seq_id)) for s in seqs]


def run_worker(config: EngineConfig, ctx: RankContext) -> None:
    """The loop of every rank but 0: receive a plan, run it, until told to shut down."""
    model_config = ModelConfig.from_model_path(config.model)
    control = ControlPlane.connect(ctx)
    runner = ModelRunner(config, model_config, ctx)
    lockstep = LockstepCheck(ctx.control_group, ctx.rank, ctx.world_size, default_every(ctx.device))
    logger.info("rank %d ready", ctx.rank)
    heap.freeze_startup_objects()
    try:
        _serve_plans(control, runner, lockstep, ctx.rank)
    finally:
        heap.release_startup_objects(collect=ctx.device.type == "cuda")


def _serve_plans(control: ControlPlane, runner: ModelRunner, lockstep: LockstepCheck, rank: int) -> None:
    while True:
        plan = control.receive()
        if plan.kind is PlanKind.SHUTDOWN:
            logger.info("rank %d shutting down", rank)
            control.close()
            runner.close()
            return
        if plan.kind is PlanKind.RUN:
            runner.execute(plan)  # tokens from the device come from rank 0 inside it
            lockstep.confirm(plan)
        elif plan.kind is PlanKind.SLEEP:
            runner.sleep(plan.arg)
        elif plan.kind is PlanKind.WAKE:
            runner.wake(bool(plan.arg & WAKE_WEIGHTS), bool(plan.arg & WAKE_KV_CACHE))
        elif plan.kind is PlanKind.RELOAD:
            runner.reload_weights()
