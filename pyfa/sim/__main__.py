"""python -m pyfa.sim: the simulator's HBM-IO reports.

    python -m pyfa.sim report --preset gpt2-medium
    python -m pyfa.sim report --preset gqa
    python -m pyfa.sim sweep --over bc --plot io_sweep_bc.png

The command line is pyfa/sim/report.py, the counting pyfa/sim/report_model.py, the formatting
pyfa/sim/report_render.py (and `python -m pyfa.sim report --help`).
"""

import sys

from .report import main

if __name__ == "__main__":
    sys.exit(main())
