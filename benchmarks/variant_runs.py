"""A benchmark's variants each measured in a process of its own: a variant changes kernels before they compile
(module globals, source text), for good in its process, so no two share one.

The script runs itself with `--child VARIANT` for each variant; the child prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Callable

from benchmarks.result_file import report


def parse_variants(value: str, known: tuple[str, ...]) -> list[str]:
    """--variants: names of `known`, comma-separated; else SystemExit naming the flag and the names."""
    names = [v for v in value.split(",") if v]
    wrong = [v for v in names if v not in known]
    if wrong or not names:
        raise SystemExit(f"--variants takes names of {', '.join(known)}; got {value!r}")
    return names


def measure_each(script: str, variants: list[str], own_triton_cache: bool = False) -> dict:
    """variant -> what `script --child variant` printed, or {"error": its last line of stderr}; each printed as it
    comes. own_triton_cache: each child compiles into a Triton cache of its own (a variant that edits a Triton
    kernel must not find the kernels as they are in the shared cache)."""
    results = {}
    for variant in variants:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache} if own_triton_cache else None
            done = subprocess.run([sys.executable, os.path.abspath(script), "--child", variant], text=True,
                                  capture_output=True, env=env)
        if done.returncode:
            results[variant] = {"error": done.stderr.strip().splitlines()[-1:]}
        else:
            results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        print(variant, results[variant], flush=True)
    return results


def main(doc: str, known: tuple[str, ...], measure: Callable[[str], dict], script: str,
         header: Callable[[], dict] = dict, own_triton_cache: bool = False) -> None:
    """A variant benchmark's command line: `--variants` (default: all of `known`), `--out FILE`; the hidden
    `--child VARIANT` prints measure(VARIANT) as JSON. Prints (and writes to --out) {**header(), "variants": ...}."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--variants", default=",".join(known))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    results = {**header(), "variants": measure_each(script, parse_variants(args.variants, known), own_triton_cache)}
    report(results, args.out)
