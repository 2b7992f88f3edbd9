"""The simulator's argument checks: pyfa/checks.py, which pyfa's API shares, so that both
refuse bad input alike (one module, named here for the simulator's own imports)."""

from ..checks import *  # noqa: F401,F403
