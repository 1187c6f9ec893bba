#!/usr/bin/env python3
"""The reliability checks of tests/reliability at full size; rewrites RELIABILITY.md with their figures.

    make reliability        # or: python3 benchmarks/reliability.py [--requests 1000 --concurrency 64 ...]

Two real servers on 127.0.0.1, with a tiny random Llama on CPU (tests/reliability/servers.py):
- load server (2 ranks, 96 KV blocks per rank): 1,000 mixed greedy requests at concurrency 64, each
  against its solo run; then 200 streams cut at random points while 200 other requests run;
- edge server (1 rank, --api-key, 1 MiB body limit): the hand-written bad requests, schemathesis
  fuzzing from /openapi.json, and every endpoint asked without the key.
The figures also go to benchmarks/results/reliability.json. Exits 1 if any check found a fault.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

from tests.reliability.auth import probe_auth  # noqa: E402
from tests.reliability.bad_requests import bad_requests, check  # noqa: E402
from tests.reliability.disconnects import cut_jobs, run_disconnects  # noqa: E402
from tests.reliability.fuzz import fuzz  # noqa: E402
from tests.reliability.load import run_load  # noqa: E402
from tests.reliability.servers import (  # noqa: E402
    EDGE_API_KEY,
    EDGE_BODY_LIMIT_MB,
    EDGE_MAX_MODEL_LEN,
    edge_server_args,
    load_server_args,
    make_model,
    running,
)
from tests.reliability.workload import make_jobs  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--cuts", type=int, default=200, help="streams to cut")
    parser.add_argument("--alongside", type=int, default=200, help="requests that run while the streams are cut")
    parser.add_argument("--fuzz-examples", type=int, default=400, help="schemathesis examples per operation and mode")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=str(REPO / "benchmarks/results/reliability.json"))
    parser.add_argument("--markdown", default=str(REPO / "RELIABILITY.md"))
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite --markdown from the figures already in --json, without running anything")
    args = parser.parse_args()
    if args.render_only:
        Path(args.markdown).write_text(render(json.loads(Path(args.json).read_text())))
        return 0

    results: dict = {"setup": _setup(args)}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(os.path.join(tmp, "tiny"))
        with running(load_server_args(model)) as url:
            started = time.perf_counter()
            jobs = make_jobs(args.requests, args.seed, max_prompt_words=96, max_tokens=48)
            results["load"] = _plain(run_load(url, jobs, args.concurrency))
            results["load"]["check_seconds"] = time.perf_counter() - started
            print("load:", json.dumps(results["load"]), flush=True)
            started = time.perf_counter()
            results["disconnects"] = _plain(run_disconnects(
                url, cut_jobs(args.cuts, args.seed + 1, max_prompt_words=32),
                make_jobs(args.alongside, args.seed + 2, max_prompt_words=64, max_tokens=24),
                concurrency=args.concurrency, seed=args.seed + 3))
            results["disconnects"]["check_seconds"] = time.perf_counter() - started
            print("disconnects:", json.dumps(results["disconnects"]), flush=True)
        with running(edge_server_args(model)) as url:
            results["bad_input"] = _hand_list(url)
            started = time.perf_counter()
            results["fuzz"] = _plain(fuzz(url, args.fuzz_examples, args.seed, api_key=EDGE_API_KEY))
            results["fuzz"]["check_seconds"] = time.perf_counter() - started
            print("fuzz:", json.dumps(results["fuzz"]), flush=True)
            results["auth"] = _plain(probe_auth(url, EDGE_API_KEY))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    Path(args.markdown).write_text(render(results))
    faults = _faults(results)
    print("\n".join(faults) if faults else f"no faults; figures in {args.markdown} and {args.json}")
    return 1 if faults else 0


def _setup(args: argparse.Namespace) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    changed = subprocess.run(["git", "status", "--porcelain", "--", "shardserve"], cwd=REPO, capture_output=True,
                             text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"date": time.strftime("%Y-%m-%d"),
            "commit": commit.stdout.strip() + (" with uncommitted changes to shardserve/" if changed else ""),
            "cpu": cpu,
            "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "args": vars(args)}


def _plain(figures) -> dict:
    """A figures dataclass as JSON-ready data (dataclasses.asdict would turn a Counter's items into keys)."""
    plain = {}
    for f in dataclasses.fields(figures):
        value = getattr(figures, f.name)
        plain[f.name] = _plain(value) if dataclasses.is_dataclass(value) else (
            {str(k): v for k, v in value.items()} if isinstance(value, dict) else value)
    if hasattr(figures, "server_errors"):
        plain["server_errors"] = figures.server_errors
    return json.loads(json.dumps(plain))


def _hand_list(url: str) -> dict:
    requests = bad_requests(EDGE_MAX_MODEL_LEN, EDGE_BODY_LIMIT_MB * 2**20)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {EDGE_API_KEY}"}, timeout=60) as http:
        problems = {r.name: check(http, r) for r in requests}
        server_errors = sum(http.post(r.path, content=r.body, headers={"content-type": r.content_type}
                                      ).status_code >= 500 for r in requests)
    return {"cases": len(requests), "right": sum(p is None for p in problems.values()), "server_errors": server_errors,
            "wrong": {name: p for name, p in problems.items() if p is not None}, "names": list(problems)}


def _faults(r: dict) -> list[str]:
    faults = []
    for name in ("load", "disconnects"):
        figures = r[name] if name == "load" else r[name]["others"]
        if figures["errors"] or figures["lost"]:
            faults.append(f"{name}: errors {figures['errors']}, lost {figures['lost']}: {figures['examples']}")
        if r[name]["leaked_blocks"]:
            faults.append(f"{name}: {r[name]['leaked_blocks']} KV blocks leaked")
    if not r["disconnects"]["healthy_after"]:
        faults.append("disconnects: the server was not healthy afterwards")
    if r["bad_input"]["wrong"] or r["bad_input"]["server_errors"]:
        faults.append(f"bad input: {r['bad_input']['wrong']}")
    if r["fuzz"]["violations"]:
        faults.append(f"fuzz: {r['fuzz']['violations']}: {r['fuzz']['examples']}")
    if r["auth"]["let_in"]:
        faults.append(f"auth: let in {r['auth']['let_in']}")
    return faults


# --------------------------------------------------------------------------- RELIABILITY.md


def _kinds(errors: dict) -> str:
    return ", ".join(f"{kind}: {n}" for kind, n in sorted(errors.items())) or "none"


def render(r: dict) -> str:
    s, load, cuts, bad, fz, auth = r["setup"], r["load"], r["disconnects"], r["bad_input"], r["fuzz"], r["auth"]
    others = cuts["others"]
    fuzz_statuses = ", ".join(f"{status}: {n:,}" for status, n in sorted(fz["by_status"].items()))
    tokens_per_s = load["completion_tokens"] / load["seconds"] if load["seconds"] else 0.0
    rows = [
        ("Load: mixed greedy requests, each against its solo run", f"{load['requests']:,}", load["concurrency"],
         load["lost"], _kinds(load["errors"]), load["leaked_blocks"], "–", sum(
             n for k, n in load["errors"].items() if k.startswith("status 5"))),
        ("Disconnects: streams cut at random points", f"{cuts['cuts']:,} cut", r["setup"]["args"]["concurrency"],
         "–", "–", cuts["leaked_blocks"], "–", "–"),
        ("... requests running meanwhile, against their solo runs", f"{others['requests']:,}", others["concurrency"],
         others["lost"], _kinds(others["errors"]), cuts["leaked_blocks"], "–",
         sum(n for k, n in others["errors"].items() if k.startswith("status 5"))),
        ("Bad input: hand-written list", bad["cases"], 1, "–",
         _kinds({"wrong answer": len(bad["wrong"])} if bad["wrong"] else {}), "–", "–", bad["server_errors"]),
        ("Bad input: schemathesis from /openapi.json", f"{fz['cases']:,}", 1, "–", _kinds(fz["violations"]), "–",
         f"{fz['cases']:,}", fz["server_errors"]),
        ("API key: every endpoint without the right key", f"{auth['asked']:,}", 1, "–",
         _kinds({"let in": len(auth["let_in"])} if auth["let_in"] else {}), "–", "–", 0),
    ]
    table = ["| Check | Requests | Concurrency | Lost | Errors by kind | Leaked KV blocks | Fuzz cases | 5xx |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    table += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    cut_points = ", ".join(f"{point} {n}" for point, n in sorted(cuts["cut_points"].items()))
    return f"""# Reliability

What the server holds under load, disconnects and bad input, and whom it lets in. Every figure below
comes from one command, which rewrites this file (and `benchmarks/results/reliability.json`):

```bash
make reliability        # python3 benchmarks/reliability.py
```

A CI-sized version of each check runs with the tests: `python3 -m pytest tests/reliability
tests/distributed/test_control_token.py` (about a minute on 2 cores).

Measured {s['date']} at commit {s['commit']} on {s['cpu']} ({s['cores']} cores), torch {s['torch']}, Python
{s['python']}; a tiny random Llama (2 layers, hidden size 96, 1,000 words) served on CPU by real
`shardserve serve` processes on 127.0.0.1, driven over HTTP.

{chr(10).join(table)}

"Lost" counts requests that got no answer at all (connection refused, reset or timed out); errors are
counted by kind: `status NNN`, `malformed` (a body or stream that breaks the OpenAI format),
`error event` (an error inside a stream), `differs from solo` (a greedy answer that differs from the
same request sent alone). "Leaked KV blocks" is read from `/metrics` (`shardserve:kv_cache_blocks_total`
minus `shardserve:kv_cache_blocks_free`) once the engine is idle.

## Load

{load['requests']:,} requests, at most {load['concurrency']} in flight, against a server with two ranks
(`-tp 2`, so every step plan crosses the signed control plane), a 256-token context and a KV cache of
96 blocks of 16 tokens per rank: half `/v1/completions` and half `/v1/chat/completions`, half streamed
(half of those with `include_usage`), prompts of 1 to 96 words, 1 to 48 output tokens, half with
`ignore_eos`, all greedy with the two best logprobs per token. Each request was first sent alone; under
load, every answer was checked for the OpenAI format (ids, objects, one choice, finish reason, usage
adding up, one stream chunk per token, `[DONE]`) and compared with its solo run.

- Well-formed and equal to the solo run: {load['answered']:,} of {load['requests']:,}
  ({load['near_ties']} of them depart from it at an exact tie: the two best tokens within 1e-4 in
  logprob at the first difference, which float32 in another batch shape may round either way).
- {load['completion_tokens']:,} tokens in {load['seconds']:.1f} s under load ({tokens_per_s:,.0f} tokens/s);
  the KV cache ran out {load['preemptions']:,} times (requests preempted and recomputed).

## Disconnects

{cuts['cuts']} streams (200 tokens asked each) cut while {others['requests']} other requests ran: {cut_points}.
`mid-body` hangs up before the request body is complete, `after-request` before the first event,
`mid-stream` after a random number of events; `close` sends a FIN, `reset` an RST (SO_LINGER 0).

- The engine was idle with every block free {cuts['idle_after_s']:.2f} s after the last client finished
  (a cut request left running would have kept it busy for seconds); healthy afterwards: {cuts['healthy_after']}.
- The requests running alongside: {others['answered']} of {others['requests']} well-formed and equal to
  their solo runs ({others['near_ties']} at an exact tie).

## Bad input

Against a server with `--api-key`, `--max-request-body-mb {EDGE_BODY_LIMIT_MB}` and `--max-model-len {EDGE_MAX_MODEL_LEN}`.
Every refusal must be a 4xx with exactly `{{"error": {{"message", "type", "param", "code"}}}}`, whose `param`
names the field at fault (and the message names it too).

- Hand-written: {bad['right']} of {bad['cases']} answered as they must: {', '.join(bad['names'])}.
- schemathesis ({fz['cases']:,} cases, {r['setup']['args']['fuzz_examples']} examples per operation for data
  the schema allows and as many for data it forbids, seed {r['setup']['args']['seed']}) on
  {', '.join(fz['operations'])}; statuses: {fuzz_statuses}. Besides the above it checks that responses
  match the schema (status codes, content types, bodies) and that data the schema forbids is refused.
  `/sleep` is left out: it would hold every later request until a wake.

## Security

- `--api-key`: {auth['refused']} of {auth['asked'] - auth['public_open']} requests to {len(auth['endpoints']) - 2}
  endpoints (every documented one, `/docs`, `/openapi.json`, an unknown path) without the key, with a
  wrong key or with the key in the wrong case got 401; `/health` and `/version` answered without it.
  The key is compared with `hmac.compare_digest`.
- The server binds 127.0.0.1 unless `--host` says otherwise; bodies over `--max-request-body-mb`
  (default 4) get a 413 before they are parsed.
- Between ranks: control data is msgpack or fixed-size integer tensors; nothing in the package imports
  pickle or calls torch.distributed's pickling `*_object` collectives. Ranks prove to each other that
  they hold the launch's control token before they join (`-tp N` makes a random one; torchrun, srun
  and `--nnodes` read `SHARDSERVE_CONTROL_TOKEN`), and every step plan is signed with it
  (tests/distributed/test_control_token.py: a rank with another token is refused, a forged plan is
  refused with a log line, the start-up exchanges unpickle nothing).
"""


if __name__ == "__main__":
    sys.exit(main())
