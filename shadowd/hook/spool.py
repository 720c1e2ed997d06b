"""A bounded on-disk spool of encoded sample batches, replayed oldest first.

Each batch is one file ``<run_id>-<seq:020d>-<samples>-<producer>.mpk`` holding the exact msgpack body
that would have been posted (producer and sequence number inside), so a replay is
byte-identical and the collector's idempotency (producer, seq) makes a repeated post harmless; the
sample count in the name lets a batch that can no longer be delivered be counted as dropped.
Files are written to a temporary name, flushed to disk and renamed, so a crash (or a power loss) never
leaves half a batch. When adding a batch would exceed ``max_bytes`` the batch is refused (the caller counts
the drop); nothing already spooled is evicted, so what is replayed is an in-order prefix.
A batch spooled before its run was registered carries run id 0 (``PENDING_RUN``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

__all__ = ["PENDING_RUN", "Spool", "SpoolEntry", "spool_dir"]

#: the run id of a batch spooled before its run was registered
PENDING_RUN = 0


def spool_dir(root: Path, run_key: str | None, rank: int, producer: str = "", stage: int = 0) -> Path:
    """The spool directory of one run key's (stage, rank) under ``root`` (``SHADOWD_SPOOL_DIR``): everything in it
    belongs to that run and to one live process at a time. Pipeline stages share TP ranks (and, on one host, the
    spool root), so a stage above 0 has a directory of its own; stage 0's is ``rank<r>``, as before stages were
    told apart. Without a run key (every registration a new run) it is the producer's own."""
    name = hashlib.sha256(run_key.encode()).hexdigest()[:12] if run_key else f"producer-{producer}"
    return Path(root) / name / (f"stage{stage}-rank{rank}" if stage else f"rank{rank}")


class SpoolEntry:
    """One spooled batch."""

    __slots__ = ("path", "producer", "run_id", "samples", "seq", "size")

    def __init__(self, path: Path) -> None:
        parts = path.stem.split("-", 3)
        if len(parts) == 4 and parts[2].isdigit():
            run, seq, samples, producer = parts
        else:  # the name of earlier versions: <run_id>-<seq>-<producer>
            (run, seq, producer), samples = path.stem.split("-", 2), "0"
        self.path = path
        self.run_id = int(run)
        self.seq = int(seq)
        self.samples = int(samples)
        self.producer = producer
        self.size = path.stat().st_size

    def read(self) -> bytes:
        return self.path.read_bytes()


class Spool:
    """The spool directory ``root`` (created on first use), bounded to ``max_bytes``."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._entries: list[SpoolEntry] | None = None
        self._bytes = 0

    def _load(self) -> list[SpoolEntry]:
        if self._entries is None:
            entries = []
            if self.root.is_dir():
                for p in self.root.glob("*.mpk"):
                    with contextlib.suppress(ValueError, OSError):
                        entries.append(SpoolEntry(p))
            entries.sort(key=lambda e: (e.producer, e.seq))
            self._entries = entries
            self._bytes = sum(e.size for e in entries)
        return self._entries

    def depth(self) -> int:
        """Batches waiting."""
        return len(self._load())

    def nbytes(self) -> int:
        self._load()
        return self._bytes

    def push(self, run_id: int, producer: str, seq: int, body: bytes, samples: int = 0) -> bool:
        """Store a batch of ``samples`` samples; False (nothing written) when the bound would be exceeded or the
        disk fails."""
        entries = self._load()
        if self._bytes + len(body) > self.max_bytes:
            return False
        name = f"{run_id}-{seq:020d}-{samples}-{producer}.mpk"
        tmp = self.root / (name + ".tmp")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.root / name)
            entry = SpoolEntry(self.root / name)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False
        entries.append(entry)
        self._bytes += entry.size
        return True

    def peek(self) -> SpoolEntry | None:
        """The oldest batch, or None."""
        entries = self._load()
        return entries[0] if entries else None

    def pop(self, entry: SpoolEntry) -> None:
        """Remove a batch that was delivered (or rejected for good)."""
        entries = self._load()
        if entry in entries:
            entries.remove(entry)
            self._bytes -= entry.size
        with contextlib.suppress(OSError):
            entry.path.unlink()
