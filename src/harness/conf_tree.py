"""Where the Hydra config tree is: ``CONF_DIR``.

The tree ships inside the package (``src/harness/conf``; ``conf/`` at the repository root links to
it), so wheels and editable installs find it alike; ``HARNESS_CONF=DIR`` points elsewhere. A module
of its own so that the CLI and the running side (``harness.setup``'s model names) read it without
importing each other.
"""
from __future__ import annotations

import os
from pathlib import Path

CONF_DIR = Path(os.environ.get("HARNESS_CONF", Path(__file__).resolve().parent / "conf"))

__all__ = ["CONF_DIR"]
