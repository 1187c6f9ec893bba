"""The start-up handshake, over the rendezvous store, before any backend or model code runs.

1. Rank 0 (on the node that launches) publishes the values of the `--forward-env` variables; every
   other rank sets them in its environment (or unsets them) before NCCL, gloo or torch read them,
   so such a variable cannot be missing or different on one node.
2. Every rank publishes its fingerprint (distributed/fingerprint.py); rank 0 compares them and
   publishes a verdict. On any difference every rank stops with the same message, naming the key,
   the ranks, their hosts and the values.

Store keys live under one prefix and are written once per start-up.
"""

from __future__ import annotations

import datetime
import json
import logging
import os

import torch.distributed as dist

from shardserve.config import EngineConfig
from shardserve.distributed import fingerprint

logger = logging.getLogger(__name__)

PREFIX = "shardserve/handshake/"


class StartupMismatch(RuntimeError):
    """The ranks do not run the same code, config or environment."""


def apply_forwarded_env(store: dist.Store, rank: int, names: tuple[str, ...]) -> dict[str, str | None]:
    """Rank 0 publishes {name: value or None}; the others apply it. Returns what was forwarded."""
    if rank == 0:
        forwarded = {name: os.environ.get(name) for name in names}
        store.set(PREFIX + "forward_env", json.dumps(forwarded))
        return forwarded
    forwarded = json.loads(store.get(PREFIX + "forward_env"))
    for name, value in forwarded.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return forwarded


def verify_same_setup(store: dist.Store, rank: int, world_size: int, config: EngineConfig) -> None:
    """Exchange fingerprints through the store; raise StartupMismatch on every rank if they differ."""
    mine = fingerprint.collect(rank, config)
    store.set(f"{PREFIX}fingerprint/{rank}", json.dumps(mine.to_json()))
    if rank == 0:
        prints = [mine] + [fingerprint.Fingerprint.from_json(json.loads(store.get(f"{PREFIX}fingerprint/{r}")))
                           for r in range(1, world_size)]
        problems = fingerprint.differences(prints)
        verdict = "" if not problems else (
            f"the {world_size} ranks do not run the same setup, so start-up stops here:\n  "
            + "\n  ".join(problems)
            + "\nMake these the same on every node, or pass a variable with --forward-env NAME on the node that "
              "launches rank 0 so every rank gets its value from there.")
        store.set(PREFIX + "verdict", verdict)
        if verdict:
            # Rank 0 hosts the store: keep it up until every rank has read why it must stop.
            _wait_quietly(store, [f"{PREFIX}verdict_read/{r}" for r in range(1, world_size)])
    else:
        verdict = store.get(PREFIX + "verdict").decode()
        store.set(f"{PREFIX}verdict_read/{rank}", "1")
    if verdict:
        raise StartupMismatch(verdict)
    if rank == 0:
        logger.info("start-up handshake: %d ranks run the same code, config and environment (source %s)",
                    world_size, mine.values["shardserve.source_sha256"][:12])


def _wait_quietly(store: dist.Store, keys: list[str], seconds: float = 30.0) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
    except RuntimeError:  # a rank that died meanwhile: stop anyway
        pass


def handshake(store: dist.Store, rank: int, world_size: int, config: EngineConfig) -> None:
    forwarded = apply_forwarded_env(store, rank, tuple(config.forward_env))
    if rank == 0 and forwarded:
        logger.info("forwarded to every rank: %s", ", ".join(
            f"{k}={'<unset>' if v is None else v}" for k, v in forwarded.items()))
    verify_same_setup(store, rank, world_size, config)
