"""What gradient scaling reports about its sites: one record per site.

Telemetry observes; it never steers. :class:`SiteRecords` holds the
:class:`SiteRecord` of every site as of its last refresh, in order of first
appearance in backward; the adapters expose it as ``hook.report()`` and
``hook.to_csv()``, and it travels in snapshots (:meth:`SiteRecords.
state_dict`) so that a resumed run logs what the straight run logs.

.. admonition:: Example

    >>> from gradient_scaling.core.telemetry import SiteRecord, SiteRecords
    >>> records = SiteRecords()
    >>> records.update({'cast#0': SiteRecord('cast#0', 'cast', 8.0)})
    >>> print(records.to_csv().splitlines()[0])
    name,kind,local_scale,input_scale,output_scale,estimated_underflow_rate,measured_underflow_rate,overflow_count,iteration

"""

import csv
import dataclasses
import io
import math

__all__ = ['SiteRecord', 'SiteRecords', 'write_csv']


@dataclasses.dataclass
class SiteRecord(object):

    """Telemetry of one scaling site, as of its last statistics refresh.

    Attributes:
        name (str): The weight's name and the function (GEMM sites), or
            ``cast#k`` / ``branch#k`` in backward traversal order.
        kind (str): ``'gemm'``, ``'cast'`` or ``'branch'``.
        local_scale (float): The local scale ``beta`` applied.
        input_scale (float): Accumulated scale ``alpha`` of the gradient
            reaching the site.
        output_scale (float): Accumulated scale of the gradient leaving it.
        estimated_underflow_rate (float): The model's rate (Theorem 1 or 2)
            at ``local_scale``; NaN for branches.
        measured_underflow_rate (float): Fraction of the non-zero values of
            the gradient leaving the site that become zero when rounded to
            the format; NaN where it cannot be measured (already stored in
            the format, or not measured).
        overflow_count (int): Skipped steps in which the site's incoming
            gradient was seen not finite.
        iteration (int): Backward pass of the last refresh.

    """

    name: str
    kind: str
    local_scale: float = 1.0
    input_scale: float = 1.0
    output_scale: float = 1.0
    estimated_underflow_rate: float = math.nan
    measured_underflow_rate: float = math.nan
    overflow_count: int = 0
    iteration: int = 0


_FIELDS = dataclasses.fields(SiteRecord)


class SiteRecords(object):

    """The committed :class:`SiteRecord` of every site, by site key."""

    def __init__(self):
        self._records = {}
        self._worst = {}  # field -> worst value, until the records change

    def __len__(self):
        return len(self._records)

    def get(self, key):
        return self._records.get(key)

    def update(self, records):
        """Commits a step's records (a dict key -> record)."""
        self._records.update(records)
        self._worst.clear()

    def count_overflows(self, names):
        """Counts a skipped step against the named sites."""
        for record in self._records.values():
            if record.name in names:
                record.overflow_count += 1

    def worst(self, field):
        """The largest value of a rate ``field`` over the records (NaN
        values left out), or None if there is none."""
        if field not in self._worst:  # (a training log asks every step)
            values = [getattr(r, field) for r in self._records.values()]
            values = [v for v in values if not math.isnan(v)]
            self._worst[field] = max(values) if values else None
        return self._worst[field]

    def report(self):
        """Copies of every record, in order of first appearance."""
        return [dataclasses.replace(r) for r in self._records.values()]

    def to_csv(self, file=None):
        """Writes :meth:`report` as CSV to a path or file; returns the text."""
        return write_csv(self._records.values(), file)

    def state_dict(self):
        """One list per field (a column), in record order."""
        records = list(self._records.values())
        return {f.name: [getattr(r, f.name) for r in records]
                for f in _FIELDS}

    def load_state_dict(self, state):
        """Restores the records; a state lacking a column (an older
        snapshot) leaves them empty until the next refresh."""
        columns = [state.get(f.name) for f in _FIELDS]
        self._records = {}
        self._worst.clear()
        if any(c is None for c in columns):
            return
        for values in zip(*columns):
            record = SiteRecord(**{
                f.name: (str(v) if f.type is str else
                         int(v) if f.type is int else float(v))
                for f, v in zip(_FIELDS, values)})
            self._records[record.name] = record


def write_csv(records, file=None):
    """Writes :class:`SiteRecord` s as CSV (one row each, every field) to
    a path or a file object; returns the text."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=[f.name for f in _FIELDS],
                            lineterminator='\n')
    writer.writeheader()
    for record in records:
        writer.writerow(dataclasses.asdict(record))
    text = out.getvalue()
    if isinstance(file, str):
        with open(file, 'w', newline='') as f:
            f.write(text)
    elif file is not None:
        file.write(text)
    return text
