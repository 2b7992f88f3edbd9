"""What every simulated kernel function shares around its body: the Options it takes
(pyfa/options.py; the simulator uses block_r, block_c and progress), the deprecated
block_r=, block_c= keywords, and the progress callback.

Progress is counted in bytes through HBM: `total` is the IO model's count for the call
(count_io, which the simulator's own record equals: tests/test_io_*.py) and `done` the
bytes the simulated kernels have recorded so far, reported as each tile's transfer is
recorded (pyfa/sim/io.py observer).
"""

import functools
import inspect

from ..checks import check_qkv
from ..errors import CancelledError
from ..options import resolve
from . import io

TILES = ("block_r", "block_c")


class _Reporter:
    def __init__(self, function, progress, total):
        self.function, self.progress, self.total, self.done = function, progress, total, 0

    def report(self):
        if self.progress(min(self.done, self.total), self.total) is True:
            raise CancelledError(f"{self.function}: cancelled by its progress callback")

    def __call__(self, nbytes):
        self.done += nbytes
        self.report()


def _total(algo, passes, args, kwargs, options):
    from .count import count_io  # count imports the kernels' modules' neighbours: load late

    layout = kwargs.get("layout", "bhnd")
    q4, k4, _, _, heads_kv = check_qkv(*args[:3], layout)
    B, H, Nq, d = q4.shape
    mask = {n: kwargs[n] for n in ("causal", "window", "causal_align") if n in kwargs}
    return count_io(algo, passes=passes, batch=B, heads=H, seqlen_q=Nq, seqlen_k=k4.shape[2],
                    head_dim=d, heads_kv=heads_kv, block_r=options.block_r,
                    block_c=options.block_c, **mask).total


def simulated(algo, passes):
    """Decorates the simulated kernel function of (algo, passes), whose body takes
    block_r= and block_c=: the public function takes options= instead (a pyfa.Options;
    None: the enclosing `with pyfa.Options(...)` block's) and reports progress."""
    def wrap(kernel):
        name = f"pyfa.sim.{kernel.__name__}"

        @functools.wraps(kernel)
        def run(*args, options=None, **kwargs):
            legacy = {n: kwargs.pop(n) for n in TILES if n in kwargs}
            options = resolve(name, options, legacy, allowed=TILES)
            tiles = dict(block_r=options.block_r, block_c=options.block_c)
            if options.progress is None:
                return kernel(*args, **tiles, **kwargs)
            reporter = _Reporter(name, options.progress, _total(algo, passes, args, kwargs, options))
            token = io.observer.set(reporter)
            try:
                result = kernel(*args, **tiles, **kwargs)
            finally:
                io.observer.reset(token)
            if reporter.done < reporter.total:
                reporter.done = reporter.total
                reporter.report()
            return result

        signature = inspect.signature(kernel)
        params = [p for n, p in signature.parameters.items() if n not in TILES]
        params.append(inspect.Parameter("options", inspect.Parameter.KEYWORD_ONLY, default=None))
        run.__signature__ = signature.replace(parameters=params)
        return run
    return wrap
