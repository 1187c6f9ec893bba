"""benchmarks/gpu_suite.commit_id, which every GPU result records: the commit a result was measured at, and a sign
where the tree measured was not that commit's (a copy of the tree whose git history is older)."""

from __future__ import annotations

import subprocess

from benchmarks.gpu_suite import commit_id


def _git(repo, *args: str) -> str:
    return subprocess.check_output(["git", *args], cwd=repo, text=True).strip()


def test_the_commit_is_heads_and_a_changed_tree_says_so(tmp_path, monkeypatch):
    monkeypatch.delenv("SHARDSERVE_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "kernel.py").write_text("BLOCK = 16\n")
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    _git(tmp_path, "add", "kernel.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "kernel")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert commit_id(str(tmp_path)) == head
    (tmp_path / "kernel.py").write_text("BLOCK = 32\n")
    assert commit_id(str(tmp_path)) == head + "+changes"
    monkeypatch.setenv("SHARDSERVE_COMMIT", "abc1234")
    assert commit_id(str(tmp_path)) == "abc1234"


def test_outside_a_checkout_it_is_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("SHARDSERVE_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert commit_id(str(tmp_path)) == "unknown"
