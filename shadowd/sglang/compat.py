"""The SGLang versions the plugin is tested against, and the startup check that refuses others.

The plugin reaches into SGLang internals (``TritonAttnBackend.forward_extend`` and its
``forward_metadata``, ``_set_kv_buffer``, ``KVWriteLoc``, the MLA KV pool), which change between
releases. An untested SGLang is refused at plugin load with a clear message; set
``SHADOWD_SGLANG_ALLOW_UNTESTED=1`` to run anyway (at your own risk: validate first).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["ALLOW_UNTESTED_ENV", "TESTED_MAX_EXCLUSIVE", "TESTED_MIN", "UntestedSGLang", "check_version",
           "installed_version", "parse_version"]

#: Tested range: ``TESTED_MIN <= version < TESTED_MAX_EXCLUSIVE`` (0.5.23 today).
TESTED_MIN = (0, 5, 23)
TESTED_MAX_EXCLUSIVE = (0, 5, 24)
ALLOW_UNTESTED_ENV = "SHADOWD_SGLANG_ALLOW_UNTESTED"


class UntestedSGLang(RuntimeError):
    """The installed SGLang is outside the tested range (and the override is not set)."""


def parse_version(version: str) -> tuple[int, ...]:
    """``"0.5.23"`` → ``(0, 5, 23)``; ``"0.5.23.post1"`` / ``"0.5.23rc0"`` → ``(0, 5, 23)`` (the release part only:
    the range check is :func:`check_version`'s, which orders pre-releases before their release)."""
    nums = []
    for part in version.strip().split(".")[:3]:
        m = re.match(r"\d+", part)
        if m is None:
            break
        nums.append(int(m.group()))
    if not nums:
        raise ValueError(f"not a version: {version!r}")
    return tuple(nums)


def installed_version() -> str | None:
    """The installed ``sglang`` distribution's version (no import of sglang), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def _in_range(version: str) -> bool:
    """``TESTED_MIN <= version < TESTED_MAX_EXCLUSIVE`` as PEP 440 orders versions: a pre- or dev release of
    ``TESTED_MIN`` (``0.5.23rc0``, ``0.5.23.dev3``) precedes it and is outside; post releases and local versions
    (``0.5.23.post1``, ``0.5.23+cu128``) are inside, and ``0.5.24rc1`` outside."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:  # (SGLang depends on packaging: a fallback for environments without it)
        try:
            release = parse_version(version)
        except ValueError:
            return False
        head = re.match(r"\s*v?\d+(?:\.\d+)*", version)
        rest = version[head.end():].split("+")[0].lower() if head else ""
        before = bool(re.match(r"[-_.]?(a|b|c|rc|alpha|beta|pre|preview|dev)", rest))
        return TESTED_MIN <= release < TESTED_MAX_EXCLUSIVE and not (before and release[:3] == TESTED_MIN)
    try:  # (``<X`` excludes X's own pre-releases: ``0.5.24rc1`` is the next release's code)
        return SpecifierSet(f">={_fmt(TESTED_MIN)},<{_fmt(TESTED_MAX_EXCLUSIVE)}").contains(Version(version),
                                                                                           prereleases=True)
    except InvalidVersion:
        return False


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def check_version(version: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """Return the SGLang version if tested (or overridden); raise :class:`UntestedSGLang` otherwise."""
    e = os.environ if env is None else env
    v = version if version is not None else installed_version()
    if v is None:
        raise UntestedSGLang("shadowd: the sglang package is not installed in this environment")
    ok = _in_range(v)
    if ok:
        return v
    if e.get(ALLOW_UNTESTED_ENV, "").strip().lower() in ("1", "true", "yes"):
        return v
    raise UntestedSGLang(
        f"shadowd: sglang {v} is outside the tested range >={_fmt(TESTED_MIN)},<{_fmt(TESTED_MAX_EXCLUSIVE)}; "
        f"the plugin hooks SGLang internals that change between releases. Install a tested sglang, unset "
        f"SHADOWD_MODE, or set {ALLOW_UNTESTED_ENV}=1 to run anyway (validate before on).")
