"""Where a benchmark's figures came from, and the one way they are appended to a results file.

Every script under bench/ labels its results with the commit it ran (:func:`commit`) and appends them with
:func:`append_results`. The device machine runs a copy of the working tree whose git metadata names the session's
base commit, not the tree really run: ``SHADOWD_BENCH_COMMIT`` (e.g. ``"a4577e5 + the session's kernel change"``)
overrides the label there.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = ["ENV_COMMIT", "append_results", "commit"]

ROOT = Path(__file__).resolve().parents[1]
#: the environment variable that labels the tree when git cannot
ENV_COMMIT = "SHADOWD_BENCH_COMMIT"


def commit(root: Path = ROOT) -> str:
    """``SHADOWD_BENCH_COMMIT`` when set; else the short HEAD of the checkout at ``root``, with
    ``" + uncommitted changes"`` when its tracked files differ from it; ``"unknown"`` without git."""
    label = os.environ.get(ENV_COMMIT, "").strip()
    if label:
        return label
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root).returncode != 0
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" + uncommitted changes" if dirty else "")


def append_results(path: str | Path | None, text: str) -> None:
    """Append ``text`` (a results section) to ``path``, creating its folder, a blank line before it when the file
    holds something; nothing when ``path`` is None."""
    if path is None:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    lead = "\n" if p.exists() and p.stat().st_size else ""
    with p.open("a") as f:
        f.write(lead + text.strip("\n") + "\n")
