"""Load: many mixed greedy requests at once; none lost, each well-formed and equal to its solo run (or
departing from it only at an exact tie, see workload.near_tie), and every KV block back in the pool
afterwards."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from tests.reliability.observe import wait_until_idle
from tests.reliability.workload import Answer, Failure, Job, near_tie, send_all, send_one_by_one


@dataclass
class LoadFigures:
    requests: int
    concurrency: int
    answered: int = 0  # well-formed answers equal to their solo run (or departing from it at a tie)
    near_ties: int = 0  # of those, answers departing from their solo run where its two best tokens tied
    lost: int = 0  # requests that got no answer at all (connection failed, reset or timed out)
    errors: Counter = field(default_factory=Counter)  # failed requests by kind, "differs from solo" included
    leaked_blocks: int = 0  # KV blocks still held once the engine is idle
    preemptions: int = 0  # requests the engine preempted for lack of KV blocks meanwhile
    completion_tokens: int = 0
    seconds: float = 0.0
    examples: list[str] = field(default_factory=list)  # the first few failures, to read

    @property
    def server_errors(self) -> int:
        return sum(n for kind, n in self.errors.items() if kind.startswith("status 5"))


def compare(jobs: list[Job], solo: dict[int, Answer | Failure], together: dict[int, Answer | Failure],
            figures: LoadFigures) -> None:
    """Tally each job's answer under load against its solo run."""
    for job in jobs:
        got, reference = together.get(job.index), solo[job.index]
        if got is None or (isinstance(got, Failure) and got.kind == "transport"):
            figures.lost += 1
        if isinstance(got, Failure) or got is None:
            _fail(figures, got.kind if got else "transport", f"job {job.index}: {got}")
        elif isinstance(reference, Failure):
            _fail(figures, "solo run failed", f"job {job.index}: {reference}")
        elif not got.same_as(reference) and not near_tie(reference, got):
            _fail(figures, "differs from solo", f"job {job.index} {job}: {got.text!r} != solo {reference.text!r}")
        else:
            figures.answered += 1
            figures.near_ties += not got.same_as(reference)
            figures.completion_tokens += got.completion_tokens


def _fail(figures: LoadFigures, kind: str, example: str) -> None:
    figures.errors[kind] += 1
    if len(figures.examples) < 5:
        figures.examples.append(example)


def run_load(url: str, jobs: list[Job], concurrency: int) -> LoadFigures:
    """Each job alone first (the references), then all of them with `concurrency` in flight."""
    figures = LoadFigures(len(jobs), concurrency)
    solo = asyncio.run(send_one_by_one(url, jobs))
    before = wait_until_idle(url)
    started = time.perf_counter()
    together = asyncio.run(send_all(url, jobs, concurrency))
    figures.seconds = time.perf_counter() - started
    compare(jobs, solo, together, figures)
    after = wait_until_idle(url)
    figures.leaked_blocks = after.blocks_used
    figures.preemptions = after.preemptions - before.preemptions
    return figures
