#!/usr/bin/env python3
"""Client-side throughput benchmark for any OpenAI-compatible server.

    python benchmarks/openai_load.py --base-url http://127.0.0.1:8011/v1 [--model NAME] \
        [--prompt TEXT] [--max-tokens 128] [--concurrency 16] [--repeats 3] [--json out.json]

Measures, with streamed /v1/completions requests (or /v1/chat/completions with --api chat):

  (a) batch-1 decode tok/s: one request of --max-tokens output tokens at a time, generation forced
      to full length (ignore_eos, plus min_tokens where the server accepts it). Decode rate is
      (completion_tokens - 1) / (time of last streamed token - time of first streamed token), so the
      prefill/first-token latency is excluded. Repeated --repeats times; the median is reported.
  (b) N-concurrent output tok/s: --concurrency requests with distinct prompts launched together;
      total completion tokens (from the servers' usage report) / wall time from launch to the last
      request finishing.

Token counts come from the usage block (stream_options.include_usage); if a server does not send
one, the number of non-empty streamed chunks is used instead and the result says so.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
from openai import AsyncOpenAI, BadRequestError

DEFAULT_PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."

# Distinct openings for the concurrent run, so no two requests share a prompt (and so prefix caching
# cannot make the batch look cheaper than it is).
TOPICS = [
    "a lighthouse keeper who finds a message in a bottle",
    "the history of the printing press",
    "how bees communicate inside the hive",
    "a chess match between two old friends",
    "why the sky appears blue during the day",
    "a traveler lost in a desert city",
    "the life cycle of a star",
    "a robot learning to paint",
    "the invention of the bicycle",
    "a storm approaching a small fishing village",
    "how volcanoes form and erupt",
    "a detective solving a mystery on a train",
    "the migration of arctic terns",
    "a baker opening a shop in a new town",
    "the first expedition to the south pole",
    "a garden that blooms only at night",
]


def concurrent_prompts(n: int) -> list[str]:
    prompts = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        suffix = f" (part {i // len(TOPICS) + 1})" if i >= len(TOPICS) else ""
        prompts.append(f"Write a detailed essay about {topic}{suffix}.")
    return prompts


@dataclass
class RequestResult:
    completion_tokens: int
    tokens_from_usage: bool
    prompt_tokens: int | None
    chunks: int
    ttft_s: float
    total_s: float
    decode_s: float
    decode_tok_s: float | None
    finish_reason: str | None
    start_s: float = 0.0  # relative to the run's start (concurrent runs)
    end_s: float = 0.0


@dataclass
class LoadConfig:
    base_url: str
    model: str
    api: str = "completions"
    max_tokens: int = 128
    temperature: float = 0.0
    use_min_tokens: bool | None = None  # None: try, drop if the server rejects it
    use_usage: bool | None = None       # None: try stream_options.include_usage, drop if rejected
    timeout_s: float = 900.0
    extra: dict = field(default_factory=dict)


class Client:
    def __init__(self, cfg: LoadConfig):
        self.cfg = cfg
        self.oai = AsyncOpenAI(
            base_url=cfg.base_url, api_key="EMPTY", max_retries=0,
            timeout=httpx.Timeout(cfg.timeout_s, connect=30.0),
            http_client=httpx.AsyncClient(
                limits=httpx.Limits(max_connections=512, max_keepalive_connections=512),
                timeout=httpx.Timeout(cfg.timeout_s, connect=30.0)),
        )

    async def close(self):
        await self.oai.close()

    def _kwargs(self, prompt: str, max_tokens: int) -> dict:
        cfg = self.cfg
        extra = {"ignore_eos": True, **cfg.extra}
        if cfg.use_min_tokens is not False:
            extra["min_tokens"] = max_tokens
        kw = dict(model=cfg.model, max_tokens=max_tokens, temperature=cfg.temperature,
                  stream=True, extra_body=extra)
        if cfg.use_usage is not False:
            kw["stream_options"] = {"include_usage": True}
        if cfg.api == "chat":
            kw["messages"] = [{"role": "user", "content": prompt}]
        else:
            kw["prompt"] = prompt
        return kw

    async def _stream(self, prompt: str, max_tokens: int) -> RequestResult:
        kw = self._kwargs(prompt, max_tokens)
        t0 = time.perf_counter()
        if self.cfg.api == "chat":
            stream = await self.oai.chat.completions.create(**kw)
        else:
            stream = await self.oai.completions.create(**kw)
        t_first = t_last = None
        chunks = 0
        usage = None
        finish = None
        async for chunk in stream:
            now = time.perf_counter()
            if getattr(chunk, "usage", None) is not None:
                usage = chunk.usage
            for choice in chunk.choices or []:
                if self.cfg.api == "chat":
                    text = getattr(choice.delta, "content", None) if choice.delta else None
                else:
                    text = choice.text
                if text:
                    chunks += 1
                    if t_first is None:
                        t_first = now
                    t_last = now
                if choice.finish_reason:
                    finish = choice.finish_reason
        t_end = time.perf_counter()
        if t_first is None:
            t_first = t_last = t_end
        if usage is not None and usage.completion_tokens is not None:
            ntok, from_usage = int(usage.completion_tokens), True
        else:
            ntok, from_usage = chunks, False
        decode_s = t_last - t_first
        rate = (ntok - 1) / decode_s if ntok > 1 and decode_s > 0 else None
        return RequestResult(
            completion_tokens=ntok, tokens_from_usage=from_usage,
            prompt_tokens=getattr(usage, "prompt_tokens", None) if usage is not None else None,
            chunks=chunks, ttft_s=t_first - t0, total_s=t_end - t0, decode_s=decode_s,
            decode_tok_s=rate, finish_reason=finish)

    async def request(self, prompt: str, max_tokens: int) -> RequestResult:
        """One streamed request; on the first call, probes which optional fields the server takes."""
        while True:
            try:
                res = await self._stream(prompt, max_tokens)
            except BadRequestError as e:
                msg = str(e).lower()
                if self.cfg.use_min_tokens is None and "min_tokens" in msg:
                    self.cfg.use_min_tokens = False
                    continue
                if self.cfg.use_usage is None and ("stream_options" in msg or "include_usage" in msg):
                    self.cfg.use_usage = False
                    continue
                if self.cfg.use_min_tokens is None:  # unspecific 400: retry once without extras
                    self.cfg.use_min_tokens = False
                    continue
                raise
            if self.cfg.use_min_tokens is None:
                self.cfg.use_min_tokens = True
            if self.cfg.use_usage is None:
                self.cfg.use_usage = res.tokens_from_usage
            return res


async def resolve_model(base_url: str, timeout: float = 30.0) -> str:
    async with httpx.AsyncClient(timeout=timeout) as c:
        r = await c.get(base_url.rstrip("/") + "/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


async def bench_batch1(client: Client, prompt: str, max_tokens: int, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        runs.append(await client.request(prompt, max_tokens))
    rates = [r.decode_tok_s for r in runs if r.decode_tok_s is not None]
    return {
        "decode_tok_s_median": statistics.median(rates) if rates else None,
        "decode_tok_s_all": rates,
        "ttft_s_median": statistics.median(r.ttft_s for r in runs),
        "completion_tokens": [r.completion_tokens for r in runs],
        "requested_tokens": max_tokens,
        "all_full_length": all(r.completion_tokens == max_tokens for r in runs),
        "runs": [asdict(r) for r in runs],
    }


async def bench_concurrent(client: Client, n: int, max_tokens: int) -> dict:
    prompts = concurrent_prompts(n)
    t0 = time.perf_counter()

    async def one(p):
        s = time.perf_counter() - t0
        r = await client.request(p, max_tokens)
        r.start_s, r.end_s = s, time.perf_counter() - t0
        return r

    runs = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    total = sum(r.completion_tokens for r in runs)
    rates = [r.decode_tok_s for r in runs if r.decode_tok_s is not None]
    return {
        "concurrency": n,
        "output_tok_s": total / wall if wall > 0 else None,
        "total_completion_tokens": total,
        "requested_tokens": n * max_tokens,
        "all_full_length": all(r.completion_tokens == max_tokens for r in runs),
        "wall_s": wall,
        "ttft_s_median": statistics.median(r.ttft_s for r in runs),
        "ttft_s_max": max(r.ttft_s for r in runs),
        "per_request_decode_tok_s_median": statistics.median(rates) if rates else None,
        "runs": [asdict(r) for r in runs],
    }


async def run_all(args) -> dict:
    model = args.model or await resolve_model(args.base_url)
    cfg = LoadConfig(base_url=args.base_url, model=model, api=args.api, max_tokens=args.max_tokens,
                     use_min_tokens={"auto": None, "on": True, "off": False}[args.min_tokens],
                     timeout_s=args.timeout)
    client = Client(cfg)
    try:
        # Warm-up: first requests often pay for lazy initialisation / compilation.
        for _ in range(args.warmup):
            await client.request(args.prompt, min(16, args.max_tokens))
        result = {
            "base_url": args.base_url, "model": model, "api": args.api, "label": args.label,
            "max_tokens": args.max_tokens, "prompt": args.prompt,
            "server_accepts_min_tokens": cfg.use_min_tokens, "usage_reported": cfg.use_usage,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        if not args.skip_batch1:
            result["batch1"] = await bench_batch1(client, args.prompt, args.max_tokens, args.repeats)
        if args.concurrency > 0:
            result["concurrent"] = await bench_concurrent(client, args.concurrency, args.max_tokens)
        result["server_accepts_min_tokens"] = cfg.use_min_tokens
        result["usage_reported"] = cfg.use_usage
        return result
    finally:
        await client.close()


def _fmt(x, nd=1):
    return "n/a" if x is None else f"{x:.{nd}f}"


def print_table(res: dict, file=sys.stdout) -> None:
    name = res.get("label") or res["model"]
    print(f"\n{name} @ {res['base_url']} (api={res['api']}, max_tokens={res['max_tokens']}, "
          f"min_tokens={'yes' if res.get('server_accepts_min_tokens') else 'no'}, "
          f"usage={'yes' if res.get('usage_reported') else 'no (chunk count)'})", file=file)
    print(f"{'metric':<36}{'value':>12}", file=file)
    print("-" * 48, file=file)
    b = res.get("batch1")
    if b:
        print(f"{'batch-1 decode tok/s (median)':<36}{_fmt(b['decode_tok_s_median']):>12}", file=file)
        print(f"{'  runs':<36}{', '.join(_fmt(x) for x in b['decode_tok_s_all']):>12}", file=file)
        print(f"{'  TTFT s (median)':<36}{_fmt(b['ttft_s_median'], 3):>12}", file=file)
        print(f"{'  completion tokens':<36}{str(b['completion_tokens']):>12}", file=file)
    c = res.get("concurrent")
    if c:
        print(f"{str(c['concurrency']) + '-concurrent output tok/s':<36}{_fmt(c['output_tok_s']):>12}", file=file)
        print(f"{'  wall s':<36}{_fmt(c['wall_s'], 2):>12}", file=file)
        print(f"{'  completion tokens (total)':<36}{c['total_completion_tokens']:>12}", file=file)
        print(f"{'  TTFT s (median / max)':<36}{_fmt(c['ttft_s_median'], 2) + ' / ' + _fmt(c['ttft_s_max'], 2):>12}", file=file)
        print(f"{'  per-request decode tok/s (med)':<36}{_fmt(c['per_request_decode_tok_s_median']):>12}", file=file)
    for key in ("batch1", "concurrent"):
        part = res.get(key)
        if part and not part["all_full_length"]:
            print(f"note: {key}: not every request produced {res['max_tokens']} tokens "
                  f"(the figures use the actual counts)", file=file)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                    help="server root including /v1 (a missing /v1 is added)")
    ap.add_argument("--model", default=None, help="model name; default: first entry of /v1/models")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt for the batch-1 runs")
    ap.add_argument("--api", choices=["completions", "chat"], default="completions")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="batch-1 repetitions (median reported)")
    ap.add_argument("--concurrency", type=int, default=16, help="0 skips the concurrent run")
    ap.add_argument("--warmup", type=int, default=1, help="short warm-up requests before measuring")
    ap.add_argument("--min-tokens", choices=["auto", "on", "off"], default="auto",
                    help="send min_tokens=max_tokens (auto: drop it if the server rejects it)")
    ap.add_argument("--skip-batch1", action="store_true")
    ap.add_argument("--timeout", type=float, default=900.0, help="per-request timeout, seconds")
    ap.add_argument("--label", default=None, help="name for this system in the output")
    ap.add_argument("--json", dest="json_out", default=None, help="write the full result here")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    if not args.base_url.endswith("/v1"):
        args.base_url += "/v1"
    res = asyncio.run(run_all(args))
    print_table(res)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
        print(f"\nwrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
