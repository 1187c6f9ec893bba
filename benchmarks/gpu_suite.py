"""GPU benchmark suite: decode speed against the memory-bandwidth roofline, offline throughput against
Hugging Face transformers, scaling over tensor-parallel sizes and bf16 agreement between them, on a
Llama-3-8B- or Llama-3-70B-shaped model with random bf16 weights (speed does not depend on the values).

    python benchmarks/gpu_suite.py                          # 8B at TP 1, 2, 4, 8 as the GPUs allow, and HF
    python benchmarks/gpu_suite.py --skip-hf --tp 1
    python benchmarks/gpu_suite.py --model llama3-70b --tp 4,8

Each phase runs in its own process (a crash or hang in one cannot take the others down); the parent
prints a table and writes benchmarks/results/<device-kind>[-<model>]-<YYYYMMDD>.json (no model part for
the 8B shape).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8}
SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}
OFFLINE_REQUESTS, OFFLINE_PROMPT, OFFLINE_OUTPUT = 512, 512, 256
HF_BATCH = 64
AGREE_PROMPTS, AGREE_TOKENS = 32, 16
DECODE_PROMPT = 128
DECODE_REPEATS, OFFLINE_REPEATS = 5, 3


def graph_replay_ms(graph, replays: int = 50) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def weight_bytes(cfg: dict) -> int:
    h, i, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    return 2 * (layers * per_layer + 2 * v * h + h)  # bf16; embedding and untied head


def write_model_dir(path: str, shape: dict = LLAMA3_8B) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(shape, f)
    # Benchmarks feed token ids; a word-level tokenizer over the whole vocabulary stands in for the real one.
    # The whitespace pre-tokenizer makes text prompts (HTTP benchmarks) count one token a word, not one in all.
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t128001", "unk_token": "t0"}, f)
    return path


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128000, (n, length), generator=g).tolist()


# -- phases (each in its own process) ----------------------------------------------------------
def phase_roofline(args) -> dict:
    import torch

    nbytes = 4 << 30
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    bw = 2 * nbytes * 10 / (time.perf_counter() - t) / 1e9
    wb = weight_bytes(SHAPES[args.model])
    return {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
            "copy_GBps": bw, "weight_bytes": wb, "roofline_tok_s": bw * 1e9 / wb}


def phase_hf(args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in LLAMA3_8B.items() if k not in ("architectures", "torch_dtype")}
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16).eval()
    out = {}
    with torch.inference_mode():
        def generate(ids, n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - t
        one = torch.tensor(random_prompts(1, DECODE_PROMPT, 5), device="cuda")
        generate(one, 4)
        out["hf_decode_bs1_tok_s"] = 48 / (generate(one, 64) - generate(one, 16))
        batch = torch.tensor(random_prompts(HF_BATCH, OFFLINE_PROMPT, 6), device="cuda")
        seconds = generate(batch, OFFLINE_OUTPUT)
        out["hf_offline_output_tok_s"] = HF_BATCH * OFFLINE_OUTPUT / seconds
        out["hf_offline_batch"] = HF_BATCH
    return out


def phase_engine(args) -> dict:
    import torch

    from shardserve.engine.sampling_params import SamplingParams
    from shardserve.entrypoints.llm import LLM

    started = time.perf_counter()
    llm = LLM(args.model_dir, tensor_parallel_size=args.tp[0], device="cuda", dtype="bfloat16", load_format="dummy",
              max_model_len=2048, max_num_seqs=OFFLINE_REQUESTS, max_num_batched_tokens=args.max_batched_tokens)
    out = {"startup_s": time.perf_counter() - started, "kv_cache_blocks": llm.engine.runner.num_blocks}
    runner = llm.engine.runner
    if runner.all_reduce_choice is not None:
        out["allreduce_choice"] = runner.all_reduce_choice.describe()
        out["allreduce_timings_us"] = {k: {str(n): round(us, 2) for n, us in t.items()}
                                       for k, t in runner.all_reduce_choice.timings_us.items()}

    def run(prompts, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        results = llm.generate(prompts, params)
        torch.cuda.synchronize()
        return time.perf_counter() - t, results

    prompt = random_prompts(1, DECODE_PROMPT, 5)
    run(prompt, 8)  # warm up (and fill the prefix cache, so both timed runs skip the same prefill)
    samples = []
    for _ in range(DECODE_REPEATS):  # run-to-run spread is a few percent: report the median and every sample
        short, _ = run(prompt, 32)
        long, _ = run(prompt, 288)
        samples.append(256 / (long - short))
    out["decode_bs1_tok_s"] = statistics.median(samples)
    out["decode_bs1_samples"] = samples
    if runner.graphs is not None and args.tp[0] == 1:  # the device's share of a step: the batch-1 graph
        # replayed alone (one rank only: with several, a graph replayed on rank 0 alone would wait in its
        # all-reduce for ranks that never join)
        out["decode_bs1_graph_replay_ms"] = graph_replay_ms(runner.graphs.graphs[1])

    _, agree = run(random_prompts(AGREE_PROMPTS, 64, 9), AGREE_TOKENS)
    out["agreement_tokens"] = [r.token_ids for r in agree]

    run(random_prompts(32, 256, 10), 32)  # warm up prefill shapes
    rates = []
    for i in range(OFFLINE_REPEATS):
        prompts = random_prompts(OFFLINE_REQUESTS, OFFLINE_PROMPT, 11 + i)  # fresh prompts: no prefix-cache hits
        seconds, results = run(prompts, OFFLINE_OUTPUT)
        produced = sum(len(r.token_ids) for r in results)
        assert produced == OFFLINE_REQUESTS * OFFLINE_OUTPUT, f"produced {produced} tokens"
        rates.append(produced / seconds)
    out["offline_output_tok_s"] = statistics.median(rates)
    out["offline_samples"] = rates
    out["preemptions"] = llm.engine.scheduler.num_preemptions
    # Report before shutting down: a teardown that hangs must not lose the measurements.
    print("RESULT " + json.dumps(out), flush=True)
    llm.shutdown()
    return out


PHASES = {"roofline": phase_roofline, "hf": phase_hf, "engine": phase_engine}


def run_phase(name: str, args, extra: list[str], timeout: int) -> dict:
    """Run one phase in a fresh process (and session). On a hang, every process of the phase (its
    spawned ranks too) is sent SIGABRT, which with PYTHONFAULTHANDLER set prints each one's stack."""
    cmd = [sys.executable, __file__, "--phase", name, "--model", args.model, "--model-dir", args.model_dir,
           "--max-batched-tokens", str(args.max_batched_tokens), *extra]
    print(f"== {name} {' '.join(extra)}", flush=True)
    t = time.perf_counter()
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    hung = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hung = True
        _signal_session(proc.pid, signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            _signal_session(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
    _signal_session(proc.pid, signal.SIGKILL)  # no rank process outlives its phase
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if hung:
        print(f"{name}: timed out after {timeout} s; stacks:\n{_stacks(stderr)}", flush=True)
        if not lines:
            return {"error": f"timed out after {timeout} s"}
        print(f"{name}: its measurements were reported before the hang; keeping them", flush=True)
    elif proc.returncode != 0 or not lines:
        print(stdout[-2000:], stderr[-6000:], sep="\n", flush=True)
        return {"error": f"exit {proc.returncode}: {stderr.strip().splitlines()[-1:]}"}
    log = [ln for ln in stderr.splitlines() if " INFO " in ln or "WARNING" in ln]
    plan = [ln for ln in log[:-20] if "kernel plan:" in ln or "WARNING" in ln]  # start-up lines worth keeping
    print("\n".join(plan + log[-20:]), flush=True)
    print(f"   ({time.perf_counter() - t:.0f} s)", flush=True)
    return json.loads(lines[-1][len("RESULT "):])


def _signal_session(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _stacks(stderr: str) -> str:
    """The log's last lines and the Python stacks faulthandler printed, without library frames."""
    keep = [ln for ln in stderr.splitlines()
            if not ("site-packages/torch/nn/modules" in ln or "/threading.py" in ln or ln.strip().startswith("^"))]
    return "\n".join(keep[-120:])


def device_kind(name: str, gpus: int) -> str:
    model = next((m for m in ("H200", "H100", "A100", "L40S", "GB10") if m in name), name.split()[-1])
    return f"nvidia-{model.lower()}" + (f"-x{gpus}" if gpus > 1 else "")


def commit_id() -> str:
    if os.environ.get("SHARDSERVE_COMMIT"):
        return os.environ["SHARDSERVE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    except Exception:
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=sorted(PHASES))
    p.add_argument("--model", choices=sorted(SHAPES), default="llama3-8b", help="the model shape (default llama3-8b)")
    p.add_argument("--tp", type=_sizes, default=None,
                   help="tensor-parallel sizes, e.g. 1,2 (default: every power of two up to the GPU count whose "
                        "share of the weights fits one GPU)")
    p.add_argument("--skip-hf", action="store_true", help="no HF transformers baseline (only run for llama3-8b)")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--phase-timeout", type=int, default=900, help="seconds before a phase counts as hung")
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.phase:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        result = PHASES[args.phase](args)
        print("RESULT " + json.dumps(result), flush=True)
        sys.stdout.flush()
        os._exit(0)  # symmetric-memory and NCCL teardown can hang at interpreter exit
    shape = SHAPES[args.model]
    args.model_dir = args.model_dir or write_model_dir(tempfile.mkdtemp(prefix=f"{args.model}-shape-"), shape)
    report = run_phase("roofline", args, [], 300)
    if "error" in report:
        return 1
    sizes = args.tp or default_sizes(report["gpus"], report["weight_bytes"], report["gpu_memory_bytes"])
    if not sizes:
        print(f"{args.model}: {report['weight_bytes'] / 1e9:.0f} GB of weights fit no tensor-parallel size on "
              f"{report['gpus']} GPU(s) of {report['gpu_memory_bytes'] / 2**30:.0f} GiB; nothing to run")
        return 2
    if not args.skip_hf and args.model == "llama3-8b":  # HF's generate holds the whole model on one GPU
        report.update(run_phase("hf", args, [], args.phase_timeout))
    engines = {tp: run_phase("engine", args, ["--tp", str(tp)], args.phase_timeout) for tp in sizes}
    results = summarize(report, engines, args.model)
    print_table(results)
    os.makedirs(args.out, exist_ok=True)
    model = "" if args.model == "llama3-8b" else f"{args.model}-"
    path = os.path.join(args.out, f"{results['device_kind']}-{model}{datetime.date.today():%Y%m%d}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")
    return 0


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(t) for t in text.split(",")})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected tensor-parallel sizes like 1,2,4, got {text!r}")
    return sizes


def default_sizes(gpus: int, weight_bytes_total: int, gpu_memory_bytes: int) -> list[int]:
    """Powers of two up to the GPU count whose share of the weights leaves a quarter of a GPU for the rest."""
    return [tp for tp in (1, 2, 4, 8, 16) if tp <= gpus and weight_bytes_total / tp <= 0.75 * gpu_memory_bytes]


def summarize(report: dict, engines: dict[int, dict], model: str = "llama3-8b") -> dict:
    wb = report["weight_bytes"]
    res = {"device": report["device"], "device_kind": device_kind(report["device"], report["gpus"]),
           "model_shape": model, "commit": commit_id(), "torch": report["torch"], "copy_GBps": report["copy_GBps"],
           "weight_bytes": wb, "roofline_tok_s": report["roofline_tok_s"],
           "hf_decode_bs1_tok_s": report.get("hf_decode_bs1_tok_s"),
           "hf_offline_output_tok_s": report.get("hf_offline_output_tok_s"), "hf_offline_batch": HF_BATCH,
           "workload": {"offline_requests": OFFLINE_REQUESTS, "prompt_tokens": OFFLINE_PROMPT,
                        "output_tokens": OFFLINE_OUTPUT, "decode_prompt_tokens": DECODE_PROMPT}}
    for tp, e in engines.items():
        if "error" in e:
            res[f"tp{tp}_error"] = e["error"]
            continue
        res[f"decode_bs1_tp{tp}_tok_s"] = e["decode_bs1_tok_s"]
        res[f"decode_bs1_tp{tp}_samples"] = e["decode_bs1_samples"]
        if "decode_bs1_graph_replay_ms" in e:
            res[f"decode_bs1_tp{tp}_graph_replay_ms"] = e["decode_bs1_graph_replay_ms"]
        res[f"offline_tp{tp}_samples"] = e["offline_samples"]
        res[f"decode_bs1_tp{tp}_GBps"] = e["decode_bs1_tok_s"] * wb / 1e9
        res[f"offline_tp{tp}_output_tok_s"] = e["offline_output_tok_s"]
        res[f"tp{tp}_startup_s"] = e["startup_s"]
        res[f"tp{tp}_preemptions"] = e["preemptions"]
        # Each rank streams 1/tp of the weights: the ideal batch-1 rate is tp times one GPU's.
        res[f"roofline_tp{tp}_tok_s"] = tp * res["roofline_tok_s"]
        res[f"decode_bs1_tp{tp}_fraction_of_roofline"] = e["decode_bs1_tok_s"] / res[f"roofline_tp{tp}_tok_s"]
        if "allreduce_choice" in e:
            res[f"tp{tp}_allreduce_choice"] = e["allreduce_choice"]
            res[f"tp{tp}_allreduce_timings_us"] = e["allreduce_timings_us"]
            if "allreduce_choice" not in res:  # the smallest group's, as before several sizes were run
                res["allreduce_choice"] = e["allreduce_choice"]
                res["allreduce_timings_us"] = e["allreduce_timings_us"]
        if "agreement_tokens" in e:  # kept, so a later run of one TP size can be compared with this one
            res[f"tp{tp}_agreement_tokens"] = e["agreement_tokens"]
    res.setdefault("allreduce_choice", "single GPU: no all-reduce")
    if res.get("hf_offline_output_tok_s") and "offline_tp1_output_tok_s" in res:
        res["offline_tp1_vs_hf"] = res["offline_tp1_output_tok_s"] / res["hf_offline_output_tok_s"]
    ran = sorted(tp for tp in engines if "decode_bs1_tok_s" in engines[tp])
    for tp in ran[1:]:  # each size against the smallest: batch-1 speed-up and bf16 agreement
        base = ran[0]
        res[f"decode_bs1_tp{tp}_speedup"] = res[f"decode_bs1_tp{tp}_tok_s"] / res[f"decode_bs1_tp{base}_tok_s"]
        a, b = engines[base].get("agreement_tokens"), engines[tp].get("agreement_tokens")
        if a and b:
            res[f"tp{base}_tp{tp}_bf16_first16_agree_fraction"] = sum(x == y for x, y in zip(a, b)) / len(a)
    return res


def print_table(r: dict) -> None:
    def fmt(key, unit="tok/s", gbps_key=None, samples_key=None, digits=1):
        v = r.get(key)
        if v is None:
            return "n/a"
        s = f"{v:,.{digits}f} {unit}"
        if gbps_key and r.get(gbps_key):
            s += f"  ({r[gbps_key]:,.0f} GB/s of weights)"
        if samples_key and r.get(samples_key):
            runs = r[samples_key]
            s += f"  [median of {len(runs)}: {min(runs):,.1f} to {max(runs):,.1f}]"
        return s

    sizes = sorted(int(k[len("tp"):-len("_startup_s")]) for k in r if k.startswith("tp") and k.endswith("_startup_s"))
    base = sizes[0] if sizes else 1
    offline = f"offline {OFFLINE_REQUESTS}x({OFFLINE_PROMPT}+{OFFLINE_OUTPUT})"
    rows = [
        ("device", f"{r['device']} ({r['device_kind']}), torch {r['torch']}, commit {r['commit']}"),
        ("model shape", r.get("model_shape", "llama3-8b")),
        ("copy bandwidth (read + write)", f"{r['copy_GBps']:,.0f} GB/s"),
        ("roofline, batch 1 (weights once per token)", f"{r['roofline_tok_s']:,.1f} tok/s on one GPU"),
    ]
    for tp in sizes:
        rows.append((f"decode batch 1, TP={tp}", fmt(f"decode_bs1_tp{tp}_tok_s", gbps_key=f"decode_bs1_tp{tp}_GBps",
                                                     samples_key=f"decode_bs1_tp{tp}_samples")))
        fraction = r.get(f"decode_bs1_tp{tp}_fraction_of_roofline")
        rows.append((f"  of the TP={tp} roofline ({tp} x one GPU's)", "n/a" if fraction is None else f"{fraction:.1%}"))
        if f"decode_bs1_tp{tp}_graph_replay_ms" in r:
            rows.append(("  graph replay alone", fmt(f"decode_bs1_tp{tp}_graph_replay_ms", "ms", digits=3)))
        if tp != base:
            rows.append((f"  TP={tp} / TP={base} at batch 1", fmt(f"decode_bs1_tp{tp}_speedup", "x", digits=2)))
            rows.append((f"  TP={base} vs TP={tp} bf16, first 16 tokens agree",
                         fmt(f"tp{base}_tp{tp}_bf16_first16_agree_fraction", "of prompts", digits=2)))
        rows.append((f"{offline}, TP={tp}", fmt(f"offline_tp{tp}_output_tok_s", samples_key=f"offline_tp{tp}_samples")))
        rows.append((f"  all-reduce choice at TP={tp}", r.get(f"tp{tp}_allreduce_choice", "none (one GPU)")))
    rows += [
        ("HF transformers decode batch 1", fmt("hf_decode_bs1_tok_s")),
        (f"HF generate, batch {HF_BATCH}", fmt("hf_offline_output_tok_s")),
        ("offline TP=1 / HF", fmt("offline_tp1_vs_hf", "x")),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    sys.exit(main())
