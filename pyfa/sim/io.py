"""The IO record: bytes moved through HBM (global memory), per tensor, read and written."""

import contextvars
from dataclasses import dataclass, field

# Sees every byte a simulated kernel records while a call with a progress callback runs
# (pyfa/sim/calls.py sets it): the one place the simulator reports progress, per tile.
observer = contextvars.ContextVar("pyfa_sim_io_observer", default=None)


@dataclass
class IORecord:
    """Bytes read from and written to HBM, per tensor name ("Q", "K", "O", "LSE", ...).

    Records add: the record of a forward and a backward pass is their sum.
    """

    reads: dict = field(default_factory=dict)
    writes: dict = field(default_factory=dict)
    label: str = ""

    def read(self, tensor, nbytes):
        self.reads[tensor] = self.reads.get(tensor, 0) + int(nbytes)
        self._observe(nbytes)

    def write(self, tensor, nbytes):
        self.writes[tensor] = self.writes.get(tensor, 0) + int(nbytes)
        self._observe(nbytes)

    @staticmethod
    def _observe(nbytes):
        seen = observer.get()
        if seen is not None:
            seen(int(nbytes))

    def scaled(self, factor):
        """The record multiplied by an integer, e.g. one head's record times B*H."""
        return IORecord({k: v * factor for k, v in self.reads.items()},
                        {k: v * factor for k, v in self.writes.items()}, self.label)

    @property
    def total_reads(self):
        return sum(self.reads.values())

    @property
    def total_writes(self):
        return sum(self.writes.values())

    @property
    def total(self):
        return self.total_reads + self.total_writes

    def tensors(self):
        names = list(self.reads)
        names += [n for n in self.writes if n not in self.reads]
        return names

    def __add__(self, other):
        out = IORecord(dict(self.reads), dict(self.writes), self.label or other.label)
        for k, v in other.reads.items():
            out.read(k, v)
        for k, v in other.writes.items():
            out.write(k, v)
        return out

    def __eq__(self, other):
        if not isinstance(other, IORecord):
            return NotImplemented
        drop0 = lambda d: {k: v for k, v in d.items() if v}
        return drop0(self.reads) == drop0(other.reads) and drop0(self.writes) == drop0(other.writes)

    def to_dict(self):
        return {"label": self.label, "reads": dict(self.reads), "writes": dict(self.writes),
                "total_reads": self.total_reads, "total_writes": self.total_writes,
                "total": self.total}

    def __str__(self):
        rows = [(n, self.reads.get(n, 0), self.writes.get(n, 0)) for n in self.tensors()]
        rows.append(("total", self.total_reads, self.total_writes))
        width = max([len(r[0]) for r in rows] + [6])
        head = f"{'tensor':<{width}}  {'read':>16}  {'written':>16}  {'total':>16}"
        lines = [self.label] if self.label else []
        lines += [head, "-" * len(head)]
        for i, (n, r, w) in enumerate(rows):
            if i == len(rows) - 1:
                lines.append("-" * len(head))
            lines.append(f"{n:<{width}}  {format_bytes(r):>16}  {format_bytes(w):>16}  "
                         f"{format_bytes(r + w):>16}")
        return "\n".join(lines)


def format_bytes(n):
    """Exact bytes below 1 KiB, else binary units with three decimals."""
    n = int(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n} B"
