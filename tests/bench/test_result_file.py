"""benchmarks/result_file.report, how the benchmark scripts leave their result: the JSON printed is the JSON
written to --out, and without --out nothing is written."""

from __future__ import annotations

import json

from benchmarks.result_file import report


def test_the_printed_result_is_the_written_one(tmp_path, capsys):
    result = {"device": "NVIDIA H200", "graph replay ms": [1.2557, 1.2564], "same tokens": True}
    out = tmp_path / "result.json"
    report(result, str(out))
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1 and json.loads(printed) == result  # one line a driver can parse
    assert json.loads(out.read_text()) == result
    report(result, None, print_indent=1)
    assert json.loads(capsys.readouterr().out) == result
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]
