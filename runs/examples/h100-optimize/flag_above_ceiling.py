"""Mark the efficiencies above their ceiling in roofline.csv files written before the harness
flagged them: each such value is left empty and kept in the row's ``above_ceiling`` note with what
to check (``harness.roofline.flags``); every other cell is unchanged.

    python runs/examples/h100-optimize/flag_above_ceiling.py runs/examples/h100-optimize/roofline.csv ...
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from harness.roofline import flags


def main(paths: list) -> int:
    if not paths:
        print(__doc__)
        return 2
    for path in map(Path, paths):
        table = pd.read_csv(path)
        marked = flags.for_csv(flags.flag_rows(table))
        path.write_text(marked.to_csv(index=False))
        for note in flags.caveats(marked):
            print(f"{path}: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
