"""Repro bundles as a user meets them: ``shadowd replay`` on bundles that are not what the writer wrote (truncated,
tampered, hand-made, another format version) answers one line and exit 64, never a traceback or a wrong OK; and
the writer's count and byte bounds hold for the directory, however many writers share it."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from shadowd.cli import EXIT_USAGE, main
from shadowd.hook.bundle import BUNDLE_FORMAT, BundleWriter
from tests.hook.conftest import base_fn, cand_fn, inputs

REFS = {"baseline": "tests.hook.conftest:base_fn", "candidate": "tests.hook.conftest:cand_fn"}


def _bundle(root: Path) -> Path:
    x, w = inputs()
    path = BundleWriter(root, 5, 2**30).save("toy", (x, w), {}, base_fn(x, w), cand_fn(x, w), {"rel_l2": 0.02},
                                             "tolerance", REFS)
    assert path is not None
    return path


def _replay(bundle: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["replay", str(bundle)])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_written_bundle_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _bundle(tmp_path / "b")
    assert json.loads((bundle / "meta.json").read_text())["format"] == BUNDLE_FORMAT
    code, out = _replay(bundle, capsys)
    assert code == 0 and "rerun baseline vs saved: max_abs 0.000e+00" in out


def _edit_meta(bundle: Path, **changes: Any) -> None:
    meta = json.loads((bundle / "meta.json").read_text())
    for k, v in changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    (bundle / "meta.json").write_text(json.dumps(meta))


BROKEN = {
    "truncated tensors": lambda b: (b / "tensors.safetensors").write_bytes(
        (b / "tensors.safetensors").read_bytes()[:300]),
    "empty tensors": lambda b: (b / "tensors.safetensors").write_bytes(b""),
    "tensors not safetensors": lambda b: (b / "tensors.safetensors").write_text("hello"),
    "truncated meta": lambda b: (b / "meta.json").write_text((b / "meta.json").read_text()[:50]),
    "meta not an object": lambda b: (b / "meta.json").write_text("[]"),
    "meta without args": lambda b: _edit_meta(b, args=None),
    "args not a list": lambda b: _edit_meta(b, args=7),
    "kwargs not an object": lambda b: _edit_meta(b, kwargs=[1]),
    "refs not an object": lambda b: _edit_meta(b, refs="tests.hook.conftest:base_fn"),
    "a ref not a string": lambda b: _edit_meta(b, refs={"baseline": 3}),
    "an argument naming no tensor": lambda b: _edit_meta(b, args=[{"tensor": "arg.0"}, {"tensor": "arg.9"}]),
    "a newer format": lambda b: _edit_meta(b, format=BUNDLE_FORMAT + 1),
    "a format that is no number": lambda b: _edit_meta(b, format="one"),
}


@pytest.mark.parametrize("damage", sorted(BROKEN))
def test_replay_of_a_broken_bundle_is_one_line_and_exit_64(damage: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _bundle(tmp_path / "b")
    BROKEN[damage](bundle)
    code, out = _replay(bundle, capsys)
    assert code == EXIT_USAGE, out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert out.startswith("shadowd replay: ") and str(bundle) in out, out


def test_a_bundle_without_format_is_read_as_the_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _bundle(tmp_path / "b")  # (bundles written before the field existed)
    _edit_meta(bundle, format=None)
    assert _replay(bundle, capsys)[0] == 0


def test_writers_never_share_a_bundle_directory(tmp_path: Path) -> None:
    """Two writers on one directory (two TP ranks, or a restarted process) with the same site and reason: each
    bundle gets a directory of its own, and none overwrites another's files."""
    x, w = inputs()
    paths = []
    for i in range(3):
        writer = BundleWriter(tmp_path, 10, 2**30)  # a new process each time
        p = writer.save("toy", (x + i, w), {}, base_fn(x, w), cand_fn(x, w), {"i": i}, "tolerance", REFS)
        assert p is not None
        paths.append(p)
    assert len(set(paths)) == 3
    assert [json.loads((p / "meta.json").read_text())["sample"]["i"] for p in paths] == [0, 1, 2]


def test_the_count_bound_holds_for_the_directory(tmp_path: Path) -> None:
    x, w = inputs()
    saved = [BundleWriter(tmp_path, 2, 2**30).save("toy", (x, w), {}, x, x, {}, "tolerance") for _ in range(4)]
    assert sum(p is not None for p in saved) == 2
    assert len(list(tmp_path.iterdir())) == 2


def test_the_byte_bound_holds_for_the_directory(tmp_path: Path) -> None:
    x, w = inputs()  # 2 KiB + 4 KiB of inputs, 1 KiB output twice: ~9 KiB a bundle
    saved = [BundleWriter(tmp_path, 100, 20_000).save("toy", (x, w), {}, base_fn(x, w), cand_fn(x, w), {}, "t")
             for _ in range(4)]
    assert sum(p is not None for p in saved) == 2
    assert sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) <= 20_000


def test_the_bounds_hold_under_concurrent_writers_in_one_process(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import shadowd.hook.bundle as bundle_mod

    real_save = bundle_mod.save_file

    def slow_save(tensors: dict[str, torch.Tensor], filename: str) -> None:  # the others run meanwhile
        time.sleep(0.1)
        real_save(tensors, filename)

    monkeypatch.setattr(bundle_mod, "save_file", slow_save)
    writer = BundleWriter(tmp_path, 3, 2**30)
    x, w = inputs()
    results: dict[int, Path | None] = {}

    def one(i: int) -> None:
        results[i] = writer.save("toy", (x, w), {}, x, x, {"i": i}, "tolerance")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    written = {i: p for i, p in results.items() if p is not None}
    assert len(written) == 3 and len(set(written.values())) == 3
    assert len(list(tmp_path.iterdir())) == 3
    for i, p in written.items():  # each holds what its own writer saved
        assert json.loads((p / "meta.json").read_text())["sample"]["i"] == i


def _process_writer(root: str, i: int) -> None:
    x, w = inputs()
    BundleWriter(Path(root), 4, 2**30).save("toy", (x, w), {}, x, x, {"i": i}, "tolerance")


def test_the_bounds_hold_under_concurrent_writer_processes(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_process_writer, args=(str(tmp_path), i)) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    bundles = list(tmp_path.iterdir())
    assert len(bundles) == 4
    for b in bundles:  # each complete and its own
        assert {f.name for f in b.iterdir()} == {"meta.json", "tensors.safetensors"}


def test_a_writer_that_died_mid_bundle_leaves_no_bundle(tmp_path: Path) -> None:
    """What a crashed writer left half-written is not a bundle (replay never sees it) and does not count."""
    x, w = inputs()
    partial = tmp_path / ".partial-00001-toy-tolerance-123"
    partial.mkdir(parents=True)
    (partial / "tensors.safetensors").write_bytes(b"\0" * 100_000)
    p = BundleWriter(tmp_path, 1, 50_000).save("toy", (x, w), {}, x, x, {}, "tolerance")
    assert p is not None and not partial.exists()
    assert [q.name for q in tmp_path.iterdir()] == [p.name]


def test_an_output_that_is_an_argument_is_saved(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A callable that writes into an ``out=`` buffer and returns it: the bundle holds the buffer twice (safetensors
    refuses tensors that share memory; the bundle was lost to that error)."""
    x, w = inputs()
    out = base_fn(x, w)
    p = BundleWriter(tmp_path, 5, 2**30).save("toy", (x, w), {"out": out}, out, out[:8], {}, "tolerance")
    assert p is not None
    code, text = _replay(p, capsys)
    assert code == 1 and "not run: no baseline and no candidate" in text  # (no refs: read, nothing to rerun)
