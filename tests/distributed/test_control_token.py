"""Only ranks that hold the launch's control token join it, and workers run only plans rank 0 signed; the
control data between ranks is msgpack, never pickle."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from tests.helpers.two_ranks import TwoRanks, serve_args
from tests.ranks import run_ranks, start_model_runner

TOKEN = "test-token"
PACKAGE = Path(__file__).resolve().parents[2] / "shardserve"


def test_a_rank_with_another_token_is_refused_and_start_up_stops(tiny_model_dir):
    ranks = TwoRanks(serve_args(tiny_model_dir("llama-untied")), env0={},
                     env1={"SHARDSERVE_CONTROL_TOKEN": "not-the-launch-token"})
    try:
        (code0, out0), (code1, out1) = ranks.wait_exit()
    finally:
        ranks.stop()
    assert code0 != 0 and code1 != 0
    assert "refused rank 1 (host " in out0 and "give every rank the same SHARDSERVE_CONTROL_TOKEN" in out0
    assert "rank 0 refused rank 1: its control token differs" in out1
    for out in (out0, out1):
        assert "not-the-launch-token" not in out and "test-control-token" not in out, "a token was logged"


def test_ranks_started_without_a_token_refuse_to_start(tiny_model_dir):
    ranks = TwoRanks(serve_args(tiny_model_dir("llama-untied")), env0={"SHARDSERVE_CONTROL_TOKEN": ""},
                     env1={"SHARDSERVE_CONTROL_TOKEN": ""})
    try:
        outcomes = ranks.wait_exit()
    finally:
        ranks.stop()
    for code, out in outcomes:
        assert code != 0
        assert "SHARDSERVE_CONTROL_TOKEN is not set: set it to the same value for every rank" in out


def _refuse_pickle(*_args, **_kwargs):
    raise AssertionError("pickle was used to decode control data")


def _forbid_unpickling() -> None:
    """Make every unpickling in this process fail, torch.distributed's own alias included."""
    import torch.distributed.distributed_c10d as c10d

    pickle.loads = pickle.Unpickler = c10d._unpickler = _refuse_pickle


def _forged_and_replayed_plans(rank: int, port: int, transport: str, results) -> None:
    """Rank 0 sends one signed plan, then one signed with another key; rank 1 must run only the first."""
    import os

    import torch

    from shardserve.distributed import control_plane
    from shardserve.distributed.control_token import control_key
    from shardserve.distributed.process_group import destroy_rank_context, init_rank_context
    from shardserve.wire.step_plan import PlanKind, SeqChunk, StepPlan

    torch.set_num_threads(1)
    _forbid_unpickling()  # nothing below may unpickle
    os.environ["SHARDSERVE_PLAN_TRANSPORT"] = transport
    ctx = init_rank_context(rank, 2, "cpu", f"tcp://127.0.0.1:{port}", control_token=TOKEN)
    try:
        gathered = control_plane.all_gather_msgpack({"rank": rank, "host": f"h{rank}"}, ctx.control_group, 2)
        assert gathered == [{"rank": 0, "host": "h0"}, {"rank": 1, "host": "h1"}]
        plan = StepPlan(1, PlanKind.RUN, [SeqChunk(7, 0, [5, 6, 7], [0], True)])
        plane = control_plane.ControlPlane.connect(ctx)
        assert plane.transport == transport
        if rank == 0:
            plane.send(plan)
            # On the same connection (TCP) or group (gloo), a plan signed with another key.
            forger = control_plane.ControlPlane(ctx.control_group, 0, 2, control_key("a guessed token"), plane.streams)
            forger.message_no = 1  # the number rank 1 expects next: only the signature is wrong
            forger.send(StepPlan(2, PlanKind.SHUTDOWN))
            results.put((0, "sent"))
            return
        receiver = plane
        assert receiver.receive() == plan
        try:
            receiver.receive()
            results.put((1, "ran the forged plan"))
        except control_plane.ControlMessageRefused as e:
            results.put((1, str(e)))
    except Exception as e:  # noqa: BLE001 - the test inspects it
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        destroy_rank_context(ctx)


@pytest.mark.parametrize("transport", ["tcp", "gloo"])
def test_workers_refuse_a_plan_not_signed_with_the_launch_key(transport):
    outcome = run_ranks(_forged_and_replayed_plans, 2, transport)
    assert outcome[0] == "sent"
    assert outcome[1] == ("rank 1 refuses a control message: step message 2 does not carry rank 0's signature "
                          "(wrong control token, or someone else on the control connection); this rank stops")


def _replicated_weights_check_without_pickle(rank: int, port: int, model_dir: str, results) -> None:
    _forbid_unpickling()  # nothing below may unpickle
    start_model_runner(rank, port, model_dir, results, TOKEN, handshake=True)  # gathers the weight digests


def test_start_up_exchanges_between_ranks_use_no_pickle(tiny_model_dir):
    outcome = run_ranks(_replicated_weights_check_without_pickle, 2, tiny_model_dir("llama-tied"))
    assert outcome == {0: "started", 1: "started"}


def test_no_object_collectives_in_the_package():
    """torch.distributed's *_object collectives pickle their payload: the package must not call any."""
    pickling = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                "send_object_list", "recv_object_list"}
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in pickling:
                calls.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.attr}")
            if isinstance(node, (ast.Import, ast.ImportFrom)) and any(a.name in ("pickle", "cPickle")
                                                                      for a in node.names):
                calls.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} import pickle")
    assert calls == []
