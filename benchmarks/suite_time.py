"""Where the test suite's time goes, by directory: the seconds pytest's `--durations=0` report gives each test's
set-up, call and tear-down, summed per directory of tests/ (a test module at the top counts as "tests/").

    python -m pytest -q -n 2 --durations=0 > after.log
    python benchmarks/suite_time.py [before.log] after.log

With two logs, the table has both and the change. The sums are seconds of a worker's time (with -n 2, two
workers run at once), not the wall-clock time pytest prints at the end, which the table's last line repeats.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

DURATION = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(tests/\S+?)::")
WALL = re.compile(r"\b(?:passed|failed)\b.* in ([\d.]+)s")
SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?)")


def by_directory(path: str) -> tuple[dict[str, float], float | None, str]:
    """(seconds per directory, the run's wall-clock seconds or None, its tests' outcome counts) of one pytest log."""
    seconds: dict[str, float] = defaultdict(float)
    wall, counts = None, ""
    with open(path, errors="replace") as f:
        for line in f:
            if match := DURATION.match(line):
                parts = match.group(3).split("/")
                directory = "/".join(parts[:2]) + "/" if len(parts) > 2 else "tests/"
                seconds[directory] += float(match.group(1))
            elif found := WALL.search(line):
                wall = float(found.group(1))
                counts = ", ".join(f"{n} {outcome}" for n, outcome in SUMMARY.findall(line))
    return dict(seconds), wall, counts


def main(paths: list[str]) -> None:
    runs = [by_directory(path) for path in paths]
    directories = sorted({d for seconds, *_ in runs for d in seconds}, key=lambda d: -runs[-1][0].get(d, 0.0))
    header = ["directory", *(f"{'before' if len(runs) == 2 and i == 0 else 'after'} (s)" for i in range(len(runs)))]
    if len(runs) == 2:
        header.append("change")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    rows = directories + ["all (worker seconds)"]
    totals = [sum(seconds.values()) for seconds, *_ in runs]
    for directory in rows:
        values = totals if directory.startswith("all") else [seconds.get(directory, 0.0) for seconds, *_ in runs]
        cells = [directory, *(f"{v:.0f}" for v in values)]
        if len(runs) == 2:
            cells.append(f"{values[1] - values[0]:+.0f}")
        print("| " + " | ".join(cells) + " |")
    walls = ["" if wall is None else f"{wall:.0f}" for _, wall, _ in runs]
    print("| wall clock | " + " | ".join(walls) + (" |" if len(runs) == 1 else " | |"))
    print("| tests | " + " | ".join(counts for *_, counts in runs) + (" |" if len(runs) == 1 else " | |"))


if __name__ == "__main__":
    if not 1 <= len(sys.argv[1:]) <= 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
