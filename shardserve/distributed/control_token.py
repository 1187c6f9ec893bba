"""The launch's shared secret: ranks prove they hold it before they join, and rank 0 signs every step plan.

Without it, anything that can reach the rendezvous port could join as a rank, or feed the workers plans.
`serve -tp N` makes a random token and hands it to the ranks it spawns; ranks started by torchrun, srun
or `--nnodes` read it from SHARDSERVE_CONTROL_TOKEN, which must hold the same value for every rank.

The token itself never crosses the network. At start-up the ranks authenticate each other over the
rendezvous store (before the fingerprint handshake and before any process group exists):
1. rank 0 publishes a fresh nonce N0;
2. every other rank r publishes its own nonce Nr and mac(key, "rank", r, N0), proving it holds the key;
3. rank 0 checks each proof and answers mac(key, "rank 0 to", r, N0, Nr), proving it holds the key too
   (Nr makes a recorded answer useless), or "refused".
Either side that sees a wrong proof logs which rank failed and stops start-up on every rank.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import secrets
import socket

import torch.distributed as dist

from shardserve import envs
from shardserve.distributed.handshake import StartupMismatch

logger = logging.getLogger(__name__)

TOKEN_ENV = envs.CONTROL_TOKEN.name
PREFIX = "shardserve/control-token/"
REFUSED = "refused"
MAC_BYTES = 16


class ControlTokenError(StartupMismatch):
    """A rank does not hold the launch's control token (or none was given)."""


def new_token() -> str:
    return secrets.token_hex(32)


def resolve_token(explicit: str | None) -> str:
    """The token this rank uses: the one it was handed, else $SHARDSERVE_CONTROL_TOKEN."""
    token = explicit or envs.CONTROL_TOKEN.get()
    if not token:
        raise ControlTokenError(
            f"ranks started by torchrun, srun or --nnodes authenticate each other with a shared secret, and "
            f"{TOKEN_ENV} is not set: set it to the same value for every rank, e.g. "
            f"export {TOKEN_ENV}=$(python3 -c 'import secrets; print(secrets.token_hex(32))')")
    return token


def control_key(token: str) -> bytes:
    """The MAC key derived from the token (the token is never used, stored or sent as such)."""
    return hashlib.sha256(b"shardserve control plane\0" + token.encode()).digest()


def mac(key: bytes, *parts: str | int | bytes) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=MAC_BYTES)
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        h.update(len(data).to_bytes(4, "little"))  # length-prefixed: parts cannot run into each other
        h.update(data)
    return h.digest()


def authenticate_ranks(store: dist.Store, rank: int, world_size: int, key: bytes) -> None:
    """Mutual proof over the rendezvous store that every rank holds `key`; raises ControlTokenError
    on every rank if one does not."""
    if rank == 0:
        _check_workers(store, world_size, key)
    else:
        _prove_to_rank0(store, rank, key)


def _check_workers(store: dist.Store, world_size: int, key: bytes) -> None:
    nonce0 = secrets.token_hex(16)
    store.set(PREFIX + "nonce", nonce0)
    refused = []
    for r in range(1, world_size):
        claim = _parse_claim(store.get(f"{PREFIX}claim/{r}"))
        if hmac.compare_digest(_hex_bytes(claim["proof"]), mac(key, "rank", r, nonce0)):
            store.set(f"{PREFIX}answer/{r}", mac(key, "rank 0 to", r, nonce0, claim["nonce"]).hex())
        else:
            store.set(f"{PREFIX}answer/{r}", REFUSED)
            refused.append(f"rank {r} (host {claim['host']})")
    if refused:
        logger.error("refused %s: wrong control token", ", ".join(refused))
        # Rank 0 hosts the store: keep it up until the refused ranks have read their answer.
        _wait_quietly(store, [f"{PREFIX}answer_read/{r}" for r in range(1, world_size)])
        raise ControlTokenError(f"{', '.join(refused)} did not prove it holds this launch's control token, so "
                                f"start-up stops here: give every rank the same {TOKEN_ENV}")


def _prove_to_rank0(store: dist.Store, rank: int, key: bytes) -> None:
    nonce0 = store.get(PREFIX + "nonce").decode()
    nonce = secrets.token_hex(16)
    claim = {"nonce": nonce, "proof": mac(key, "rank", rank, nonce0).hex(), "host": socket.gethostname()}
    store.set(f"{PREFIX}claim/{rank}", json.dumps(claim))
    answer = store.get(f"{PREFIX}answer/{rank}").decode()
    store.set(f"{PREFIX}answer_read/{rank}", "1")
    if answer == REFUSED:
        logger.error("rank %d: rank 0 refused this rank's control token", rank)
        raise ControlTokenError(f"rank 0 refused rank {rank}: its control token differs from rank 0's; give every "
                                f"rank the same {TOKEN_ENV}")
    if not hmac.compare_digest(_hex_bytes(answer), mac(key, "rank 0 to", rank, nonce0, nonce)):
        logger.error("rank %d: the rendezvous answered without proof of the control token", rank)
        raise ControlTokenError(f"rank {rank}: the rank 0 reached at the rendezvous address did not prove it "
                                f"holds this launch's control token, so this rank does not join it")


def _parse_claim(data: bytes) -> dict[str, str]:
    """A rank's claim as published; anything malformed reads as a claim without proof."""
    try:
        claim = json.loads(data)
        return {field: str(claim.get(field, "")) for field in ("nonce", "proof", "host")}
    except (ValueError, AttributeError):
        return {"nonce": "", "proof": "", "host": "?"}


def _hex_bytes(text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        return b""


def _wait_quietly(store: dist.Store, keys: list[str], seconds: float = 30.0) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
    except RuntimeError:  # a rank that died meanwhile: stop anyway
        pass
