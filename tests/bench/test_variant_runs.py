"""benchmarks/variant_runs.py: each variant measured by a process of its own, a child's failure reported beside the
others rather than ending the run."""

from __future__ import annotations

import textwrap

import pytest

from benchmarks.variant_runs import measure_each, parse_variants


def test_each_variant_runs_in_a_child_and_a_failing_one_is_reported(tmp_path, capsys):
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        variant = sys.argv[sys.argv.index("--child") + 1]
        if variant == "broken":
            raise SystemExit("the broken variant's kernel did not compile")
        print("compiling...")
        print(json.dumps({"variant": variant, "pid": os.getpid(), "cache": os.environ.get("TRITON_CACHE_DIR")}))
    """))
    got = measure_each(str(script), ["as-is", "broken", "fast"], own_triton_cache=True)
    assert got["as-is"]["variant"] == "as-is" and got["fast"]["variant"] == "fast"
    assert got["as-is"]["pid"] != got["fast"]["pid"]
    assert got["as-is"]["cache"] and got["as-is"]["cache"] != got["fast"]["cache"]  # a Triton cache each
    assert got["broken"] == {"error": ["the broken variant's kernel did not compile"]}
    assert "broken {'error'" in capsys.readouterr().out


def test_variant_names_come_from_the_list_given():
    assert parse_variants("b,a", ("a", "b")) == ["b", "a"]
    for wrong in ("a,c", ""):
        with pytest.raises(SystemExit, match="--variants takes names of a, b"):
            parse_variants(wrong, ("a", "b"))


def test_the_command_line_measures_each_variant_by_its_child_and_writes_the_results(tmp_path):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "bench.py"
    script.write_text(textwrap.dedent('''
        """A benchmark of two variants."""
        import os
        from benchmarks import variant_runs
        variant_runs.main(__doc__, ("a", "b"), lambda v: {"v": v, "pid": os.getpid()}, __file__,
                          lambda: {"device": "none"})
    '''))
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(script), "--variants", "b,a", "--out", str(out)], text=True,
                          capture_output=True, env={**os.environ, "PYTHONPATH": root}, timeout=60)
    assert done.returncode == 0, done.stderr
    got = json.loads(out.read_text())
    assert got["device"] == "none" and list(got["variants"]) == ["b", "a"]
    assert got["variants"]["a"]["v"] == "a" and got["variants"]["a"]["pid"] != got["variants"]["b"]["pid"]
    wrong = subprocess.run([sys.executable, str(script), "--variants", "c"], text=True, capture_output=True,
                           env={**os.environ, "PYTHONPATH": root}, timeout=60)
    assert wrong.returncode != 0 and "--variants takes names of a, b; got 'c'" in wrong.stderr
