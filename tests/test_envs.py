"""The environment-variable registry: every variable the package reads is declared, read typed, refused by name
when malformed, and documented in docs/environment.md exactly as declared."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from shardserve import envs

PACKAGE = Path(envs.__file__).resolve().parent


def test_the_committed_docs_table_is_the_registry():
    text = envs.DOCS.read_text()
    assert envs.docs_with_table(text) == text, "docs/environment.md differs: run python -m shardserve.envs --write-docs"


def test_every_shardserve_variable_named_in_the_package_is_declared():
    named = {m for path in PACKAGE.rglob("*.py")
             for m in re.findall(r"SHARDSERVE_[A-Z0-9_]*[A-Z0-9]", path.read_text())}
    assert named - envs.REGISTRY.keys() == set(), "declare them in shardserve/envs.py"


def test_values_are_read_typed_at_call_time_and_a_bad_one_is_named():
    with envs.override(SHARDSERVE_PDL=None, SHARDSERVE_FOLD_SHARED_EXPERT=None, SHARDSERVE_LOCKSTEP_EVERY=None,
                       SHARDSERVE_STALL_RESTART_S=None):
        assert (envs.PDL.get(), envs.FOLD_SHARED_EXPERT.get(), envs.LOCKSTEP_EVERY.get(),
                envs.STALL_RESTART_S.get()) == ("auto", True, None, 30.0)
    with envs.override(SHARDSERVE_PDL="off", SHARDSERVE_FOLD_SHARED_EXPERT="0", SHARDSERVE_LOCKSTEP_EVERY="4",
                       SHARDSERVE_STALL_RESTART_S="2.5"):
        assert (envs.get("SHARDSERVE_PDL"), envs.FOLD_SHARED_EXPERT.get(), envs.LOCKSTEP_EVERY.get(),
                envs.STALL_RESTART_S.get()) == ("off", False, 4, 2.5)
    with envs.override(SHARDSERVE_PDL=""):  # empty: as if unset
        assert envs.PDL.get() == "auto"
    for var, bad, expected in ((envs.PDL, "yes", "one of auto, on, off"), (envs.FOLD_SHARED_EXPERT, "no", "1 or 0"),
                               (envs.LOCKSTEP_EVERY, "often", "an integer"),
                               (envs.STALL_RESTART_S, "-1", "a positive number of seconds")):
        with envs.override({var.name: bad}), pytest.raises(ValueError, match=f"{var.name}='{bad}': expected "):
            var.get()


def test_override_sets_the_process_environment_and_restores_it():
    before = {name: os.environ.get(name) for name in ("SHARDSERVE_GEMV", "SHARDSERVE_PDL")}
    os.environ["SHARDSERVE_PDL"] = "on"
    try:
        with envs.override({"SHARDSERVE_GEMV": "cublas"}, SHARDSERVE_PDL=None):
            assert os.environ["SHARDSERVE_GEMV"] == "cublas" and "SHARDSERVE_PDL" not in os.environ
        assert os.environ.get("SHARDSERVE_GEMV") == before["SHARDSERVE_GEMV"] and os.environ["SHARDSERVE_PDL"] == "on"
    finally:
        envs._put("SHARDSERVE_PDL", before["SHARDSERVE_PDL"])
    with pytest.raises(KeyError, match="SHARDSERVE_NO_SUCH"), envs.override(SHARDSERVE_NO_SUCH="1"):
        pass


def test_the_kernel_plan_shows_the_declared_overrides_and_all_reduce_accepts_its_methods():
    from shardserve.distributed import all_reduce
    from shardserve.kernels import plan

    assert plan.OVERRIDE_ENV == tuple(v.name for v in envs.REGISTRY.values() if v.plan)
    assert envs.ALL_REDUCE.choices == all_reduce.METHOD_NAMES + all_reduce.CPU_METHOD_NAMES
    with envs.override(SHARDSERVE_GEMV="cublas", ONEDNN_MAX_CPU_ISA="avx2", SHARDSERVE_OVERLAP_STEPS="1"):
        shown = plan.overrides_in_effect()
    assert "SHARDSERVE_GEMV=cublas" in shown and "ONEDNN_MAX_CPU_ISA=avx2" in shown
    assert not any(s.startswith("SHARDSERVE_OVERLAP_STEPS") for s in shown)
