"""Grammar engines for structured outputs, side by side on the host: xgrammar against llguidance.

    python benchmarks/grammar_backends.py [--tokenizer models/SmolLM2-135M-Instruct.Q4_1.gguf]
        [--batch 1,32,256] [--steps 256] [--reps 9] [--threads N] [--out results.json]

--tokenizer is a Hugging Face tokenizer directory or a .gguf file (`python3 -m shardserve fetch-example`
writes the default one). Needs no GPU and no network. An engine that does not import is skipped, and the
output says so. Per engine:

  setup     the engine's tokenizer built from the transformers tokenizer (once per model)
  new       a constraint never seen before: compile + a fresh matcher + its first mask. Each repetition sends
            a different constraint (a property renamed, a choice or a rule suffixed) and xgrammar's compile
            cache is cleared first, so nothing is reused.
  cached    the same constraint again, each engine's fastest way: xgrammar, a hit in its compile cache + a new
            matcher + first mask; llguidance keeps no compiled grammar, so a matcher kept at its start state,
            deep_copy() + first mask. "compiled kept, new matcher": a new matcher from the compiled grammar
            (llguidance: from the grammar text, which sets its parser up again) + first mask.
  mask      one decode step: the masks of B rows into one [B, vocab/32] int32 bitmask, through the engine's
            batch API, and row by row in a Python loop (both must agree). Row i walks the tokens of a valid
            document for the schema from its own offset, and starts again from a fresh state at its end; every
            mask must allow the row's next token.
  accept    one decode step: each of the B rows takes its token, through the engine's batch API.
  apply     masking logits [B, vocab] float32 in place with a filled bitmask: each engine's function and plain
            torch (unpack the bits, masked_fill -inf); GB/s counts the logits read and written.
  check     at the start of the small schema: some allowed token starts with "{", none with a letter, and the
            end-of-sequence token is allowed only once a document is complete; and which tokens one engine
            allows there that the other does not.

JSON comes out in one fixed layout in both engines (", " and ": ", no other whitespace), as the server's.
Times are medians in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from importlib.metadata import version

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

DEFAULT_TOKENIZER = "models/SmolLM2-135M-Instruct.Q4_1.gguf"


def strict(properties: dict) -> dict:
    """An object schema as OpenAI strict mode wants it: every property required, nothing else allowed."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


SMALL = strict({"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}})
SMALL_DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"}

ADDRESS = strict({"street": {"type": "string"}, "city": {"type": "string"}, "postcode": {"type": "string"},
                  "country": {"type": "string"}})
ITEM = strict({"sku": {"type": "string"}, "quantity": {"type": "integer"}, "unit_price": {"type": "number"},
               "tags": {"type": "array", "items": {"type": "string"}}})
LARGE = strict({
    "order_id": {"type": "string"},
    "status": {"type": "string", "enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
    "created_at": {"type": "string"},
    "customer": strict({"name": {"type": "string"}, "email": {"type": "string"},
                        "tier": {"type": "string", "enum": ["free", "pro", "enterprise"]}}),
    "items": {"type": "array", "items": ITEM},
    "shipping": strict({"method": {"type": "string", "enum": ["ground", "air", "pickup"]}, "address": ADDRESS}),
    "notes": {"type": ["string", "null"]},
    "gift": {"type": "boolean"},
    "total": {"type": "number"},
})
LARGE_DOC = {
    "order_id": "A-10293", "status": "shipped", "created_at": "2024-05-17T09:24:00Z",
    "customer": {"name": "Grace Hopper", "email": "grace@navy.mil", "tier": "enterprise"},
    "items": [
        {"sku": "KB-101", "quantity": 2, "unit_price": 49.5, "tags": ["keyboard", "usb"]},
        {"sku": "MS-7", "quantity": 1, "unit_price": 19.99, "tags": []},
        {"sku": "CB-USB-C", "quantity": 3, "unit_price": 7.25, "tags": ["cable", "usb-c", "1m"]},
    ],
    "shipping": {"method": "air", "address": {"street": "1 Main St", "city": "Arlington", "postcode": "22201",
                                              "country": "US"}},
    "notes": None, "gift": False, "total": 140.74,
}
EMAIL = r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,TLD}"  # TLD: the longest top-level domain
CHOICES = ["positive", "negative", "neutral", "mixed"]
GBNF = 'root ::= expr\nexpr ::= term%s (("+" | "-") term%s)*\nterm%s ::= [0-9]+ | "(" expr ")"\n'


def renamed(schema: dict, rep: int) -> dict:
    """The schema with its first property renamed: the same shape, but a constraint no cache has seen."""
    props = dict(schema["properties"])
    first = next(iter(props))
    props = {(f"{first}_{rep}" if k == first else k): v for k, v in props.items()}
    return {**schema, "properties": props, "required": list(props)}


def constraint(kind: str, rep: int) -> tuple[str, object]:
    """(kind, spec) of constraint `kind`, distinct for each repetition `rep` (rep < 0: the plain one)."""
    plain = rep < 0
    if kind in ("small", "large"):
        schema = SMALL if kind == "small" else LARGE
        return "json", schema if plain else renamed(schema, rep)
    if kind == "json_object":
        return "json", {"type": "object"}
    if kind == "regex":
        return "regex", EMAIL.replace("TLD", str(6 if plain else 7 + rep))
    if kind == "choice":
        return "choice", CHOICES if plain else CHOICES[:-1] + [f"{CHOICES[-1]}-{rep}"]
    suffix = "" if plain else str(rep)
    return "grammar", GBNF % (suffix, suffix, suffix)


KINDS = ("small", "large", "json_object", "regex", "choice", "grammar")


class Engine:
    """What the benchmark asks of a grammar engine; one subclass per engine."""

    name: str
    version: str
    batch_api: str

    def compile(self, kind: str, spec: object) -> object: ...
    def clear_cache(self) -> None: ...
    def matcher(self, compiled: object) -> object: ...
    def cached(self, spec: tuple[str, object]) -> Callable[[], object]: ...  # new matchers, once seen
    def fill_one(self, matcher: object, bitmask: torch.Tensor, row: int = 0) -> None: ...
    def fill(self, matchers: list, bitmask: torch.Tensor) -> None: ...
    def accept(self, matchers: list, tokens: list[int]) -> list[bool]: ...
    def accept_one(self, matcher: object, token: int) -> bool: ...
    def reset(self, matcher: object) -> None: ...
    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None: ...


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, hf, vocab_size: int, eos_ids: list[int], threads: int) -> None:
        import xgrammar as xg
        self.xg, self.version = xg, version("xgrammar")
        self.info = xg.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos_ids)
        self.compiler = xg.GrammarCompiler(self.info, max_threads=threads)
        self.batch = xg.BatchGrammarMatcher(max_threads=threads)
        self.batch_api = (f"BatchGrammarMatcher(max_threads={threads}).batch_fill_next_token_bitmask, "
                          "BatchGrammarMatcher.batch_accept_token")

    def compile(self, kind, spec):
        layout = dict(any_whitespace=False, separators=(", ", ": "), strict_mode=True)
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(spec), **layout)
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        if kind == "choice":
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
        return self.compiler.compile_grammar(spec)

    def clear_cache(self):
        self.compiler.clear_cache()

    def matcher(self, compiled):
        return self.xg.GrammarMatcher(compiled)

    def cached(self, spec):
        self.compile(*spec)
        return lambda: self.matcher(self.compile(*spec))

    def fill_one(self, matcher, bitmask, row=0):
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers, tokens):
        return self.xg.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def accept_one(self, matcher, token):
        return matcher.accept_token(token)

    def reset(self, matcher):
        matcher.reset()

    def apply(self, logits, bitmask):
        self.xg.apply_token_bitmask_inplace(logits, bitmask)


class LLGuidance(Engine):
    name = "llguidance"
    LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def __init__(self, hf, vocab_size: int, eos_ids: list[int], threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg, self.llt, self.version = llguidance, llguidance.torch, version("llguidance")
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos_ids)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.par_accept = hasattr(llguidance.torch, "consume_token_par")
        self.batch_api = (f"llguidance.torch.fill_next_token_bitmask_par(LLExecutor(num_threads={threads})), "
                          + ("consume_token_par" if self.par_accept else "LLMatcher.consume_token per row"))

    def compile(self, kind, spec):
        M = self.llg.LLMatcher
        if kind == "json":
            grammar = M.grammar_from_json_schema(spec, overrides=self.LAYOUT)
        elif kind == "regex":
            grammar = M.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        else:
            grammar = self.llg.grammar_from("grammar", spec)  # GBNF, converted to Lark
        return grammar

    def clear_cache(self):
        pass  # nothing compiled is kept between matchers

    def matcher(self, compiled):
        m = self.llg.LLMatcher(self.tok, compiled)
        if m.is_error():
            raise ValueError(f"llguidance refuses the grammar: {m.get_error()}")
        return m

    def cached(self, spec):
        return self.matcher(self.compile(*spec)).deep_copy

    def fill_one(self, matcher, bitmask, row=0):
        self.llt.fill_next_token_bitmask(matcher, bitmask, row)

    def fill(self, matchers, bitmask):
        self.llt.fill_next_token_bitmask_par(self.executor, list(zip(matchers, range(len(matchers)))), bitmask)

    def accept(self, matchers, tokens):
        if self.par_accept:
            return self.llt.consume_token_par(self.executor, list(zip(matchers, tokens)))
        return [m.consume_token(t) for m, t in zip(matchers, tokens)]

    def accept_one(self, matcher, token):
        return matcher.consume_token(token)

    def reset(self, matcher):
        matcher.reset()

    def apply(self, logits, bitmask):
        self.llt.apply_token_bitmask_inplace(logits, bitmask)


ENGINES = {"xgrammar": XGrammar, "llguidance": LLGuidance}
SHIFTS = torch.arange(32, dtype=torch.int32)


def torch_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The bitmask applied with plain torch: bit j of word w allows token 32 * w + j."""
    bits = (bitmask.unsqueeze(-1) >> SHIFTS) & 1
    allowed = bits.view(bitmask.shape[0], -1)[:, :logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def allowed_ids(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask_row.unsqueeze(-1) >> SHIFTS) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def first_mask(engine: Engine, kinds: tuple[str, ...], reps: int, vocab: int) -> dict:
    """Per constraint kind: compile + matcher + first mask, new (median over distinct constraints) and cached."""
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    engine.fill_one(engine.matcher(engine.compile("json", {"type": "integer"})), bitmask)  # one-time start-up
    out = {}
    for kind in kinds:
        new, compile_only = [], []
        for rep in range(reps):
            spec = constraint(kind, rep)
            engine.clear_cache()
            started = time.perf_counter()
            compiled = engine.compile(*spec)
            compiled_at = time.perf_counter()
            engine.fill_one(engine.matcher(compiled), bitmask)
            done = time.perf_counter()
            new.append((done - started) * 1e3)
            compile_only.append((compiled_at - started) * 1e3)
        spec = constraint(kind, -1)
        compiled, again = engine.compile(*spec), engine.cached(spec)
        out[kind] = {"new_ms": statistics.median(new), "new_max_ms": max(new),
                     "compile_ms": statistics.median(compile_only),
                     "cached_ms": median_ms(lambda: engine.fill_one(again(), bitmask), reps),
                     "new_matcher_ms": median_ms(lambda: engine.fill_one(engine.matcher(compiled), bitmask), reps)}
    return out


def steady_state(engine: Engine, compiled: object, doc: list[int], batch: int, steps: int, vocab: int) -> dict:
    """B rows, each walking `doc` from its own offset: per step, the time to fill all masks (through the batch
    API, and row by row in a loop) and to accept. Both ways must give the same masks."""
    matchers = [engine.matcher(compiled) for _ in range(batch)]
    n = len(doc)
    pos = [(i * n) // batch if batch <= n else i % n for i in range(batch)]
    for m, p in zip(matchers, pos):
        for t in doc[:p]:
            if not engine.accept_one(m, t):
                raise RuntimeError(f"{engine.name} refused token {t} of a valid document")
    bitmask = torch.zeros(batch, (vocab + 31) // 32, dtype=torch.int32)
    serial_bitmask = torch.zeros_like(bitmask)
    rows = torch.arange(batch)
    fills, serial, accepts, violations, differ = [], [], [], 0, 0

    def fill_serially():
        for i, m in enumerate(matchers):
            engine.fill_one(m, serial_bitmask, i)

    for step in range(steps):
        tokens = [doc[p] for p in pos]
        ways = [(lambda: engine.fill(matchers, bitmask), fills), (fill_serially, serial)]
        for fn, times in ways[::-1] if step % 2 else ways:  # alternated: neither always finds the caches warm
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        ok = engine.accept(matchers, tokens)
        accepts.append((time.perf_counter() - started) * 1e3)
        nxt = torch.tensor(tokens)
        violations += int((((bitmask[rows, nxt >> 5] >> (nxt & 31)) & 1) == 0).sum()) + ok.count(False)
        differ += int((bitmask != serial_bitmask).any(dim=1).sum())
        for i in range(batch):
            pos[i] += 1
            if pos[i] == n:  # a finished document: the row starts a new one
                engine.reset(matchers[i])
                pos[i] = 0
    fill_ms = statistics.median(fills)
    return {"mask_ms": fill_ms, "mask_us_per_row": fill_ms * 1e3 / batch,
            "mask_row_by_row_ms": statistics.median(serial), "accept_ms": statistics.median(accepts),
            "violations": violations, "batch_differs_from_row_by_row": differ, "bitmask": bitmask}


def apply_times(appliers: dict[str, Callable], bitmask: torch.Tensor, vocab: int, reps: int) -> dict:
    """Per function: time per call, and whether it masks exactly the tokens plain torch masks."""
    fresh = torch.randn(bitmask.shape[0], vocab)
    expected = fresh.clone()
    torch_apply(expected, bitmask)
    gbytes = 2 * fresh.numel() * 4 / 1e9
    out = {}
    for name, fn in appliers.items():
        try:
            logits = fresh.clone()
            started = time.perf_counter()
            fn(logits, bitmask)  # llguidance compiles its kernel with torch.compile at the first call
            first = (time.perf_counter() - started) * 1e3
            same = torch.equal(logits, expected)
            ms = median_ms(lambda: fn(logits, bitmask), reps)
            out[name] = {"ms": ms, "gb_per_s": gbytes / (ms / 1e3), "first_call_ms": first, "same_as_torch": same}
        except Exception as exc:  # noqa: BLE001 - reported, not fatal: the other engines still run
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    return out


def check_start(engine: Engine, hf, vocab: int, eos_ids: list[int], doc: list[int]) -> dict:
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    m = engine.matcher(engine.compile(*constraint("small", -1)))
    engine.fill_one(m, bitmask)
    allowed = allowed_ids(bitmask[0], vocab)
    texts = [hf.decode([t]) for t in allowed]
    for t in doc:
        engine.accept_one(m, t)
    engine.fill_one(m, bitmask)
    at_end = allowed_ids(bitmask[0], vocab)
    return {"allowed_at_start": len(allowed), "brace_allowed": any(s.startswith("{") for s in texts),
            "letter_allowed": [s for s in texts if s[:1].isalpha()][:5],
            "eos_at_start": any(t in allowed for t in eos_ids), "eos_at_end": any(t in at_end for t in eos_ids),
            "ids": allowed}


def run_engine(cls, hf, vocab, eos_ids, docs, args) -> tuple[dict, Engine, dict]:
    """The engine's measurements, the engine, and per batch size the bitmask of its last step (large schema)."""
    started = time.perf_counter()
    engine = cls(hf, vocab, eos_ids, args.threads)
    result: dict = {"version": engine.version, "batch_api": engine.batch_api,
                    "setup_ms": (time.perf_counter() - started) * 1e3}
    result["check"] = check_start(engine, hf, vocab, eos_ids, docs["small"])
    result["first_mask"] = first_mask(engine, KINDS, args.reps, vocab)
    result["steady"], last_masks = {}, {}
    for kind, doc in docs.items():
        compiled = engine.compile(*constraint(kind, -1))
        for b in args.batch:
            r = steady_state(engine, compiled, doc, b, args.steps, vocab)
            last_masks[(kind, b)] = r.pop("bitmask")
            result["steady"][f"{kind} B={b}"] = r
    return result, engine, {b: last_masks[("large", b)] for b in args.batch}


def print_table(report: dict, names: list[str]) -> None:
    res = report["engines"]
    width = 16
    print("\n" + "measurement".ljust(44) + "".join(n.rjust(width) for n in names))

    def row(label: str, cell: Callable[[dict], str]) -> None:
        print(label.ljust(44) + "".join(cell(res[n]).rjust(width) for n in names))

    row("setup: engine's tokenizer (ms)", lambda r: f"{r['setup_ms']:.0f}")
    for kind in KINDS:
        row(f"{kind}: new, compile+1st mask (ms)", lambda r: f"{r['first_mask'][kind]['new_ms']:.2f}")
        row(f"{kind}:   of which compile (ms)", lambda r: f"{r['first_mask'][kind]['compile_ms']:.2f}")
        row(f"{kind}: cached (ms)", lambda r: f"{r['first_mask'][kind]['cached_ms']:.3f}")
        row(f"{kind}: compiled kept, new matcher (ms)", lambda r: f"{r['first_mask'][kind]['new_matcher_ms']:.3f}")
    for key in res[names[0]]["steady"]:
        row(f"mask {key} (ms/step, us/row)",
            lambda r: f"{r['steady'][key]['mask_ms']:.3f} ({r['steady'][key]['mask_us_per_row']:.0f})")
        row(f"mask {key}, row by row (ms/step)", lambda r: f"{r['steady'][key]['mask_row_by_row_ms']:.3f}")
        row(f"accept {key} (ms/step)", lambda r: f"{r['steady'][key]['accept_ms']:.3f}")
        row(f"check {key}: next barred, ways differ",
            lambda r: f"{r['steady'][key]['violations']}, {r['steady'][key]['batch_differs_from_row_by_row']}")
    cols = names + ["torch"]
    print("\n" + "apply [B, vocab] f32 (ms, GB/s)".ljust(44) + "".join(n.rjust(width) for n in cols))
    for b, per in report["apply"].items():
        cells = [(f"{per[n]['ms']:.3f} ({per[n]['gb_per_s']:.0f})" + ("" if per[n]["same_as_torch"] else " WRONG")
                  if "ms" in per[n] else "error") for n in cols]
        print(f"B={b}".ljust(44) + "".join(c.rjust(width) for c in cells))
    print()
    for n in names:
        c = res[n]["check"]
        print(f"{n}: batch API {res[n]['batch_api']}")
        print(f"{n}: start of small schema: {c['allowed_at_start']} tokens allowed, '{{' token allowed "
              f"{c['brace_allowed']}, tokens starting with a letter {c['letter_allowed'] or 'none'}, "
              f"EOS at start {c['eos_at_start']}, EOS after a complete document {c['eos_at_end']}")
        for b, per in report["apply"].items():
            if "error" in per[n]:
                print(f"{n}: apply B={b}: {per[n]['error']}")
        first = [f"{per[n]['first_call_ms']:.0f}" for per in report["apply"].values() if "first_call_ms" in per[n]]
        print(f"{n}: apply, first call per batch size (ms): {', '.join(first)}")


def load_tokenizer(path: str) -> tuple[object, int, list[int]]:
    """(transformers tokenizer, vocabulary size, end-of-sequence ids), through the server's own loader; a
    directory still loads with transformers alone where that loader's dependencies (gguf) are missing."""
    try:
        from shardserve.tokenizer import Tokenizer
    except ImportError as exc:
        if not os.path.isdir(path):
            sys.exit(f"cannot read {path} without the server's tokenizer loader ({exc}): pass a tokenizer directory")
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(path)
        return hf, len(hf), [hf.eos_token_id]
    tok = Tokenizer.from_model_path(path)
    return tok.hf_tokenizer, tok.vocab_size, sorted(tok.eos_token_ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="Hugging Face tokenizer directory or .gguf")
    p.add_argument("--batch", default="1,32,256", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=256, help="decode steps timed per schema and batch")
    p.add_argument("--reps", type=int, default=9, help="repetitions of each first-mask measurement")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="engine and torch threads")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    torch.set_num_threads(args.threads)

    if not os.path.exists(args.tokenizer):
        sys.exit(f"no tokenizer at {args.tokenizer}: pass --tokenizer DIR_OR_GGUF, or run "
                 "`python3 -m shardserve fetch-example` for the default one")
    hf, vocab, eos_ids = load_tokenizer(args.tokenizer)
    docs = {k: hf.encode(json.dumps(d), add_special_tokens=False) for k, d in (("small", SMALL_DOC),
                                                                               ("large", LARGE_DOC))}
    report: dict = {
        "host": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                 "threads": args.threads, "python": platform.python_version(), "torch": torch.__version__},
        "tokenizer": {"path": args.tokenizer, "vocab": vocab, "eos": eos_ids,
                      "doc_tokens": {k: len(v) for k, v in docs.items()}},
        "args": {"batch": args.batch, "steps": args.steps, "reps": args.reps},
        "engines": {}, "skipped": {}, "apply": {},
    }
    print(f"tokenizer {args.tokenizer}: vocab {vocab}, documents of {report['tokenizer']['doc_tokens']} tokens; "
          f"{args.threads} threads on {os.cpu_count()} cores; python {platform.python_version()}, "
          f"torch {torch.__version__}")
    appliers, masks = {}, {}
    for name in args.engines.split(","):
        try:
            __import__(name)
        except Exception as exc:  # noqa: BLE001 - an engine that fails to import (or its dependencies) is skipped
            report["skipped"][name] = f"not importable: {exc}"
            print(f"{name}: skipped, not importable ({exc})")
            continue
        started = time.perf_counter()
        report["engines"][name], engine, last_masks = run_engine(ENGINES[name], hf, vocab, eos_ids, docs, args)
        print(f"{name} {engine.version}: measured in {time.perf_counter() - started:.0f} s")
        appliers[name] = engine.apply
        masks = masks or last_masks
    names = list(report["engines"])
    if not names:
        sys.exit("no grammar engine importable: pip install llguidance (and/or xgrammar)")
    for b in args.batch:
        report["apply"][b] = apply_times({**appliers, "torch": torch_apply}, masks[b], vocab, 20)
    if len(names) == 2:  # the tokens one engine allows at the start of the small schema and the other does not
        a, b = (set(report["engines"][n]["check"]["ids"]) for n in names)
        report["check_start_only_in"] = {names[0]: [hf.decode([t]) for t in sorted(a - b)][:10],
                                         names[1]: [hf.decode([t]) for t in sorted(b - a)][:10]}
    for n in names:
        report["engines"][n]["check"].pop("ids")
    print_table(report, names)
    if len(names) == 2:
        print("tokens allowed at the start of the small schema by one engine only: "
              + "; ".join(f"{n}: {texts or 'none'}" for n, texts in report["check_start_only_in"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
