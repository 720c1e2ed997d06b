"""The SGLang plugin's entry point: ``[project.entry-points."sglang.srt.plugins"] shadowd =
"shadowd.sglang_plugin:register"``. The plugin itself lives in :mod:`shadowd.sglang`
(see :mod:`shadowd.sglang.plugin`); this module only names it, and imports nothing of sglang.
"""

from __future__ import annotations

from shadowd.sglang.plugin import register

__all__ = ["register"]
