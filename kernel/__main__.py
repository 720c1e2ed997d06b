"""``python -m mla_tree_verify``: print the library path (building it if needed)."""

from .build import main

raise SystemExit(main())
