"""python -m pyfa.sim: the simulator's HBM-IO reports.

    python -m pyfa.sim report --preset gpt2-medium
    python -m pyfa.sim sweep --over bc --plot io_sweep_bc.png

See sim/report.py (and `python -m pyfa.sim report --help`).
"""

import sys

from .report import main

if __name__ == "__main__":
    sys.exit(main())
