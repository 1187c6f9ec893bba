"""Speculative decoding with a DeepSeek checkpoint's MTP layer (engine/mtp.py), on a tiny random DeepSeek-V3 with a
random MTP layer written into its checkpoint: greedy tokens equal those of the engine without it at TP 1 and 2; 16
requests at once equal each alone; preemption and an abort lose no tokens and leak no block of either pool; dummy
weights, sleep and wake; every proposal made while generating (after rejected proposals, and with every proposal
accepted) equals the argmax of a float32 reference built from the same weights in plain torch and transformers (and
a corrupted eh_proj makes them differ); a checkpoint without an MTP layer or another architecture is refused naming
why; without MTP the layer's tensors are left unread with one log line."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from shardserve.entrypoints.llm import LLM
from tests.helpers.reference import one_torch_thread, random_prompts
from tests.helpers.state_models import assert_all_returned, greedy

NEW_TOKENS = 12
OPTIONS = {"device": "cpu", "dtype": "float32", "kv_cache_memory_gb": 0.01, "max_num_seqs": 8}


def _mtp(k: int = 2, method: str = "mtp") -> dict:
    return {"method": method, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    """The tiny DeepSeek-V3 (3 decoder layers, the MTP layer sparse) with num_nextn_predict_layers 1 and its MTP
    layer as model.layers.3.*."""
    from tests.tiny_models import DEEPSEEK_SPECS, add_mtp_layer, make_tiny_model

    spec = DEEPSEEK_SPECS["deepseek-v3"]
    path = str(tmp_path_factory.mktemp("deepseek-v3-mtp"))
    return add_mtp_layer(spec, make_tiny_model(spec, path))


def assert_mtp_returned(llm: LLM) -> None:
    """Every block of the MTP layer's pool free, nothing kept for any sequence."""
    proposer = llm.engine.proposer
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks, "an MTP block leaked"
    assert not proposer.caches and not proposer.hiddens


def _generate(llm: LLM, prompts, params) -> list[list[int]]:
    """The tokens of `prompts`, requests never stopping to propose (a random MTP layer's proposals would stop
    paying after 8 tokens; these tests are about what verifying them gives)."""
    if llm.engine.proposer is not None:
        llm.engine.proposer.break_even = 0.0
    return [list(o.token_ids) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_tokens_with_mtp_equal_those_without(mtp_model, tp):
    prompts = random_prompts([3, 11, 25], seed=9)
    with LLM(mtp_model, tensor_parallel_size=tp, **OPTIONS) as llm:
        plain = _generate(llm, prompts, greedy(NEW_TOKENS))
    with LLM(mtp_model, tensor_parallel_size=tp, speculative_config=_mtp(method="deepseek_mtp"), **OPTIONS) as llm:
        assert _generate(llm, prompts, greedy(NEW_TOKENS)) == plain
        stats = llm.engine.stats()
        assert_all_returned(llm)
        assert_mtp_returned(llm)
    assert stats.spec_drafts > 0


def test_dummy_weights_draw_the_mtp_layer_too(mtp_model):
    """--load-format dummy: the MTP layer's weights are drawn as the target's are, and the greedy tokens are those of
    the dummy target alone."""
    prompts = random_prompts([6, 19], seed=5)
    with LLM(mtp_model, load_format="dummy", **OPTIONS) as llm:
        plain = _generate(llm, prompts, greedy(NEW_TOKENS))
    with LLM(mtp_model, load_format="dummy", speculative_config=_mtp(), **OPTIONS) as llm:
        assert _generate(llm, prompts, greedy(NEW_TOKENS)) == plain
        assert llm.engine.stats().spec_drafts > 0
        assert_mtp_returned(llm)


def test_sixteen_at_once_equal_each_alone_and_preemption_and_an_abort_lose_nothing(mtp_model):
    """16 prompts of many lengths in one batch (caught up together in passes cut by the token budget) equal each
    alone; then a target cache too small for every sequence at once preempts some mid-speculation, and a request
    aborted between steps gives back the blocks of both pools: the tokens are those of the first run."""
    prompts = random_prompts([3 + 3 * i for i in range(16)], seed=7)
    options = {**OPTIONS, "max_num_seqs": 16, "max_num_batched_tokens": 64}
    with LLM(mtp_model, speculative_config=_mtp(k=3), **options) as llm:
        together = _generate(llm, prompts, greedy(NEW_TOKENS))
        alone = [_generate(llm, [p], greedy(NEW_TOKENS))[0] for p in prompts]
        assert llm.engine.stats().spec_drafts > 16
        assert_all_returned(llm)
        assert_mtp_returned(llm)
    assert together == alone
    small = {**options, "kv_cache_memory_gb": 0.00006, "max_model_len": 64}
    with LLM(mtp_model, speculative_config=_mtp(k=3), **small) as llm:
        assert llm.engine.block_manager.num_blocks * 16 < sum(len(p) + NEW_TOKENS for p in prompts[8:])
        assert _generate(llm, prompts[8:], greedy(NEW_TOKENS)) == together[8:]
        assert llm.engine.scheduler.num_preemptions > 0
        engine = llm.engine
        engine.add_request("gone", prompts[4], greedy(NEW_TOKENS))
        for _ in range(3):
            engine.step()
        assert engine.proposer.caches and engine.proposer.hiddens, "the request was not speculating when aborted"
        engine.abort("gone")
        assert_all_returned(llm)
        assert_mtp_returned(llm)


def _proposals_while_generating(llm: LLM, prompts) -> list[tuple[list[int], list[int]]]:
    """Every (sequence's tokens, the MTP proposals for it) the engine made while generating `prompts`."""
    proposer, made = llm.engine.proposer, []
    propose_all = proposer.propose_all

    def recorded(requests):
        out = propose_all(requests)
        made.extend((list(seq.token_ids), drafts) for (seq, _), drafts in zip(requests, out) if drafts)
        return out

    proposer.propose_all = recorded
    try:
        _generate(llm, prompts, greedy(NEW_TOKENS))
    finally:
        del proposer.propose_all  # the class's again
    return made


def test_the_mtp_layer_sleeps_and_wakes_with_the_engine(mtp_model):
    """After sleeping at level 1 (weights kept in host memory) and level 2 (reloaded from the checkpoint), the
    proposals and tokens are those before sleeping."""
    prompts = random_prompts([5, 17], seed=4)
    with LLM(mtp_model, speculative_config=_mtp(), **OPTIONS) as llm:
        before = _proposals_while_generating(llm, prompts)
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            assert _proposals_while_generating(llm, prompts) == before
        assert_mtp_returned(llm)


class ReferenceMtp:
    """The target and its MTP layer in float32 from the checkpoint: transformers' DeepseekV3 for the target's hidden
    states before its final norm (a hook on model.norm) and, loaded one layer deeper, for the MTP layer's decoder
    layer; enorm, hnorm, eh_proj and shared_head in plain torch."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path)
        self.index = config.num_hidden_layers
        with one_torch_thread():
            self.target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            config.num_hidden_layers += 1
            deeper = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
        self.layer, self.rotary = deeper.model.layers[self.index], deeper.model.rotary_emb
        self.eps = config.rms_norm_eps
        with safe_open(f"{path}/mtp.safetensors", "pt") as f:
            self.w = {k.removeprefix(f"model.layers.{self.index}."): f.get_tensor(k) for k in f.keys()}

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[f"{name}.weight"]

    @torch.inference_mode()
    def proposals(self, tokens: list[int], k: int) -> list[int]:
        """The MTP layer's k greedy proposals after `tokens`: rows 0 .. n-2 take (t_{i+1}, h_i), each further row
        the proposal and the MTP layer's output at the row before; the row of position 0 a zero embedding."""
        kept = {}

        def keep(module, args, out) -> None:
            kept["h"] = args[0][0]

        hook = self.target.model.norm.register_forward_hook(keep)
        with one_torch_thread():
            self.target(torch.tensor([tokens[:-1]]))
        hook.remove()
        inputs, hidden, made = list(tokens[1:]), kept["h"], []
        for _ in range(k):
            embedded = self.target.model.embed_tokens(torch.tensor(inputs))
            embedded[0] = 0
            x = torch.cat((self._norm(embedded, "enorm"), self._norm(hidden, "hnorm")), -1) @ self.w["eh_proj.weight"].T
            positions = torch.arange(len(inputs)).unsqueeze(0)
            with one_torch_thread():
                out = self.layer(x.unsqueeze(0), position_ids=positions,
                                 position_embeddings=self.rotary(x.unsqueeze(0), positions))[0]
            logits = self._norm(out, "shared_head.norm") @ self.w["shared_head.head.weight"].T
            made.append(int(logits[-1].argmax()))
            inputs, hidden = inputs + made[-1:], torch.cat((hidden, out[-1:]))
        return made


@pytest.fixture(scope="module")
def reference(mtp_model) -> ReferenceMtp:
    return ReferenceMtp(mtp_model)


def test_every_proposal_equals_a_float32_reference_of_the_mtp_layer(mtp_model, reference):
    """The first proposal after each prompt and every later one (after verified steps whose rejected proposals'
    entries must be recomputed from the target's states) equal the reference's from the sequence's tokens alone."""
    prompts = random_prompts([4, 13], seed=3)
    with LLM(mtp_model, speculative_config=_mtp(k=2), **OPTIONS) as llm:
        made = _proposals_while_generating(llm, prompts)
    assert len(made) > 2 * len(prompts)
    assert [drafts for _, drafts in made] == [reference.proposals(tokens, len(drafts)) for tokens, drafts in made]


def test_proposals_after_accepted_ones_equal_the_reference(mtp_model, reference):
    """Every proposal accepted (verification forced to take them all, then the target's token after the last): the
    hidden states of a verified step's rows for the accepted positions feed the next catch up, and the proposals
    still equal the reference's from the sequence's tokens alone."""
    prompts = random_prompts([4, 13], seed=3)
    with LLM(mtp_model, speculative_config=_mtp(k=3), **OPTIONS) as llm:
        sampler = llm.engine.sampler

        def accept_all(logits, seqs):
            ends = torch.tensor([len(drafts) for _, _, drafts in seqs]).add(1).cumsum(0).sub(1)
            return [drafts + [t] for (_, _, drafts), t in zip(seqs, logits[ends].argmax(-1).tolist())]

        sampler.verify = accept_all
        made = _proposals_while_generating(llm, prompts)
        stats = llm.engine.stats()
        assert_mtp_returned(llm)
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 2 * len(prompts)
    assert [drafts for _, drafts in made] == [reference.proposals(tokens, len(drafts)) for tokens, drafts in made]


def test_a_corrupted_eh_proj_makes_the_proposals_differ_from_the_reference(mtp_model, reference, tmp_path):
    """The comparison above is not vacuous: served from a copy of the checkpoint whose eh_proj has its two halves
    swapped (the token's and the hidden state's inputs exchanged), the proposals are no longer the reference's."""
    from safetensors.torch import load_file, save_file

    copy = shutil.copytree(mtp_model, tmp_path / "corrupted")
    tensors = load_file(copy / "mtp.safetensors")
    name = f"model.layers.{reference.index}.eh_proj.weight"
    tensors[name] = torch.cat(tensors[name].chunk(2, dim=1)[::-1], dim=1).contiguous()
    save_file(tensors, copy / "mtp.safetensors")
    prompts = random_prompts([4, 13], seed=3)
    with LLM(str(copy), speculative_config=_mtp(k=2), **OPTIONS) as llm:
        made = _proposals_while_generating(llm, prompts)
    assert [drafts for _, drafts in made] != [reference.proposals(tokens, len(drafts)) for tokens, drafts in made]


def _without_mtp_layer(tmp_path, path: str, value) -> str:
    """A copy of the checkpoint whose config.json has num_nextn_predict_layers `value` (None: no such key)."""
    copy = shutil.copytree(path, tmp_path / "copy")
    config = json.loads((copy / "config.json").read_text())
    config.pop("num_nextn_predict_layers")
    if value is not None:
        config["num_nextn_predict_layers"] = value
    (copy / "config.json").write_text(json.dumps(config))
    return str(copy)


@pytest.mark.parametrize("value", [None, 0])
def test_a_checkpoint_without_an_mtp_layer_is_refused_naming_the_key_in_llm_and_at_the_cli(mtp_model, tmp_path,
                                                                                           value):
    from shardserve.cli import parse_args
    from shardserve.entrypoints.serve import serve

    path = _without_mtp_layer(tmp_path, mtp_model, value)
    message = ("--speculative-config: method 'mtp' needs the checkpoint's multi-token-prediction layer.*"
               "no num_nextn_predict_layers, or 0")
    with pytest.raises(ValueError, match=message):
        LLM(path, speculative_config=_mtp(), **OPTIONS)
    with pytest.raises(SystemExit, match=f"shardserve serve: {message}"):
        serve(parse_args(["serve", path, "--device", "cpu", "--speculative-config", json.dumps(_mtp())]))


@pytest.mark.parametrize("model, message", [
    ("llama-untied", "method 'mtp' needs a DeepSeek-V2/V3 checkpoint .* is a LlamaForCausalLM"),
    ("qwen3-next", "method 'mtp': the MTP layers of Qwen3NextForCausalLM are not supported yet"),
])
def test_other_architectures_are_refused(tiny_model_dir, model, message):
    with pytest.raises(ValueError, match=f"--speculative-config: {message}"):
        LLM(tiny_model_dir(model), speculative_config=_mtp(), **OPTIONS)


def test_without_mtp_the_layer_is_left_unread_with_one_log_line(mtp_model, caplog):
    """And with MTP, where rank 0's MTP runner reads them, the target's load says nothing of them."""
    with caplog.at_level(logging.INFO, logger="shardserve.weights.loader"):
        with LLM(mtp_model, speculative_config=_mtp(), **OPTIONS):
            pass
        assert not [r for r in caplog.records if "multi-token-prediction" in r.getMessage()]
        with LLM(mtp_model, **OPTIONS) as llm:
            assert llm.engine.proposer is None
    from safetensors import safe_open

    with safe_open(f"{mtp_model}/mtp.safetensors", "pt") as f:
        count = len(f.keys())
    skipped = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(skipped) == 1 and f"left {count} tensors of the multi-token-prediction layers" in skipped[0], skipped


def test_shardserve_plan_gives_the_mtp_and_target_caches_the_engine_builds(mtp_model, capsys):
    """`shardserve plan --speculative-config '{"method": "mtp", ...}'` sets the MTP layer's latent cache and the
    target's out of rank 0's budget as the engine does; the layer's weights within 5% of what the engine sets aside
    for them on a GPU (the layer built on the meta device)."""
    from shardserve.cli import main

    assert main(["plan", mtp_model, "--device", "cpu", "--kv-cache-memory", "0.01", "--max-num-seqs", "8",
                 "--speculative-config", json.dumps(_mtp()), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    with LLM(mtp_model, speculative_config=_mtp(), **OPTIONS) as llm:
        block = llm.engine.runner.block_size
        target_tokens = llm.engine.runner.num_blocks * block
        mtp_tokens = llm.engine.proposer.runner.num_blocks * block
        target_config = llm.engine.model_config
    assert planned["draft_cache_tokens"] == mtp_tokens
    assert target_tokens <= planned["max_tokens_in_cache"] < target_tokens + block
    # The weights as a GPU plan counts them, in the checkpoint's 16-bit dtype (a CPU plan adds compact copies).
    assert main(["plan", mtp_model, "--device", "cuda", "--gpu-memory-gb", "80", "--speculative-config",
                 json.dumps(_mtp()), "--json"]) == 0
    planned_elements = json.loads(capsys.readouterr().out)["draft_weight_bytes"] / 2
    elements = _meta_mtp_elements(target_config)
    assert abs(planned_elements - elements) <= 0.05 * elements, (planned_elements, elements)


def _meta_mtp_elements(target_config) -> int:
    from shardserve.distributed.communicator import Communicator
    from shardserve.engine.mtp import mtp_model_config
    from shardserve.models.deepseek_mtp import DeepseekMTP

    with torch.device("meta"):
        model = DeepseekMTP(mtp_model_config(target_config), Communicator(None, 0, 1), torch.bfloat16, 512)
    return sum(p.numel() for p in model.parameters())
