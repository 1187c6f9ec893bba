"""A benchmark's result as the scripts leave it: printed as JSON (the last line a driver parses) and, where the
command line names a file (--out), written there."""

from __future__ import annotations

import json


def report(result: dict, out: str | None, print_indent: int | None = None) -> None:
    """Print `result` as JSON (indented by print_indent, or on one line) and write it to `out` where given."""
    print(json.dumps(result, indent=print_indent))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
