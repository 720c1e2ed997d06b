"""bench/provenance.py: the commit label every benchmark's results carry, and how they are appended."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

import pytest


def _provenance() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "provenance.py"
    spec = importlib.util.spec_from_file_location("bench_provenance", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prov = _provenance()


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_the_label_is_the_short_head_and_says_when_the_tree_differs(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(prov.ENV_COMMIT, raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "k.cu").write_text("one\n")
    _git(tmp_path, "add", "k.cu")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert prov.commit(tmp_path) == head
    (tmp_path / "k.cu").write_text("two\n")
    assert prov.commit(tmp_path) == f"{head} + uncommitted changes"
    _git(tmp_path, "add", "k.cu")  # staged is still not the commit
    assert prov.commit(tmp_path) == f"{head} + uncommitted changes"


def test_the_environment_labels_a_copy_whose_git_is_not_its_tree(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(prov.ENV_COMMIT, raising=False)
    assert prov.commit(tmp_path) == "unknown"  # no git here
    monkeypatch.setenv(prov.ENV_COMMIT, "a4577e5 + the kernel change")
    assert prov.commit(tmp_path) == "a4577e5 + the kernel change"


def test_sections_are_appended_with_a_blank_line_between(tmp_path: Path) -> None:
    path = tmp_path / "results" / "x-2026-12-07.md"
    prov.append_results(None, "nothing")
    prov.append_results(path, "# heading\n")
    prov.append_results(path, "\n## run 1\n\n| a |\n")
    prov.append_results(path, "## run 2")
    assert path.read_text() == "# heading\n\n## run 1\n\n| a |\n\n## run 2\n"
