"""Which claim each row of a DataProto came from: flowrl's per-row bookkeeping.

A claim's handle (task, lease, sample indices, ...) travels row by row, never in
``meta_info``: verl's ``DataProto.concat`` refuses ``meta_info`` values that differ, and
batches from separate claims differ in their lease. The keys hold a ``:``, which no flowrl
column name (a Python identifier) can, so they never collide with a user's key:

* ``batch["flowrl:rows"]``: ``(n, 8)`` int64, one row per sample: index, version, group,
  unit, tokens, lease, dp_rank and the lease deadline (a float64's bits);
* ``non_tensor_batch["flowrl:task"]``: the task each row was claimed for (str).

Both survive every verl operation that moves rows (``chunk``, ``concat``, ``reorder``,
``union``, ``repeat``, ``pad_dataproto_to_divisor``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flowrl._client.base import HubClient
from flowrl._controller.meta import BatchMeta
from flowrl.errors import ConfigError
from flowrl.integrations._dataproto_infer import host

__all__ = [
    "ROWS_KEY",
    "TASK_KEY",
    "ack_dataproto",
    "batch_meta",
    "dataproto_claims",
    "rows_of",
]

ROWS_KEY = "flowrl:rows"
TASK_KEY = "flowrl:task"
_FIELDS = ("index", "version", "group", "unit", "tokens", "lease", "dp_rank", "deadline")
_COL = {name: i for i, name in enumerate(_FIELDS)}


def rows_of(meta: BatchMeta) -> tuple[np.ndarray, np.ndarray]:
    """The ``(n, 8)`` bookkeeping of a claim's rows and their task names."""
    n = len(meta)
    rows = np.empty((n, len(_FIELDS)), dtype=np.int64)
    rows[:, _COL["index"]] = meta.indices
    rows[:, _COL["version"]] = meta.versions
    rows[:, _COL["group"]] = meta.groups
    rows[:, _COL["unit"]] = meta.units
    rows[:, _COL["tokens"]] = meta.tokens
    rows[:, _COL["lease"]] = meta.lease
    rows[:, _COL["dp_rank"]] = meta.dp_rank
    rows[:, _COL["deadline"]] = np.float64(meta.deadline).view(np.int64)
    tasks = np.empty(n, dtype=object)
    tasks[:] = meta.task
    return rows, tasks


def batch_meta(dp: Any, columns: tuple[str, ...], nbytes: int) -> BatchMeta:
    """The handle of ``dp``'s rows: the claim's own when every row comes from one claim
    (``hub.ack`` takes it); otherwise an unleased one (lease 0) holding the rows' sample
    indices (for ``hub.put(indices=...)``): settle those leases with :func:`ack_dataproto`.
    A DataProto verl built (no bookkeeping) gets index -1 on every row."""
    found = _bookkeeping(dp)
    if found is None:
        rows = np.full((len(dp), len(_FIELDS)), -1, dtype=np.int64)
        rows[:, [_COL[f] for f in ("tokens", "lease", "dp_rank", "deadline")]] = 0
        return _meta(rows, "", 0, columns, nbytes)
    rows, tasks = found
    claims = set(zip(tasks.tolist(), rows[:, _COL["lease"]].tolist(), strict=True))
    if len(claims) != 1:
        return _meta(rows, "", 0, columns, nbytes)
    ((task, lease),) = claims
    return _meta(rows, str(task), int(lease), columns, nbytes)


def dataproto_claims(dp: Any) -> list[BatchMeta]:
    """One handle per claim the rows of ``dp`` came from (a concat of batches from several
    claims holds several), each with its rows once (verl's ``pad_dataproto_to_divisor``
    repeats rows): ``hub.ack(m, m.indices)``, ``hub.release(m)`` or ``put(indices=m)``.
    Rows that were never claimed (lease 0) have none."""
    found = _bookkeeping(dp)
    if found is None:
        raise ConfigError(
            "dataproto_claims() expects a DataProto made by to_dataproto (or a chunk, concat "
            f"or union of some): it has no {ROWS_KEY!r} tensor and {TASK_KEY!r} array, so its "
            "rows were never claimed from a hub"
        )
    rows, tasks = found
    leases = rows[:, _COL["lease"]]
    out = []
    for task, lease in dict.fromkeys(zip(tasks.tolist(), leases.tolist(), strict=True)):
        if lease == 0:  # read with hub.meta() or never in a hub: nothing to settle
            continue
        mine = np.flatnonzero((leases == lease) & (tasks == task))
        _, first = np.unique(rows[mine, _COL["index"]], return_index=True)
        out.append(_meta(rows[mine[np.sort(first)]], str(task), int(lease), (), 0))
    return out


def ack_dataproto(hub: HubClient, dp: Any) -> int:
    """Ack every row of ``dp`` (each sample once, in the claim it came from), however many
    claims verl's ``concat`` joined; the number of samples acked. A claim the hub no longer
    holds (acked before, expired) raises ``LeaseError``; the claims before it (in the order
    of ``dataproto_claims``) stay acked."""
    claims = dataproto_claims(dp)
    for meta in claims:
        hub.ack(meta, meta.indices)
    return sum(len(m) for m in claims)


def _meta(
    rows: np.ndarray, task: str, lease: int, columns: tuple[str, ...], nbytes: int
) -> BatchMeta:
    def field(name: str) -> np.ndarray:
        return np.ascontiguousarray(rows[:, _COL[name]])

    return BatchMeta(
        task=task,
        lease=lease,
        columns=columns,
        indices=field("index"),
        units=field("unit").astype(np.int16),
        tokens=field("tokens"),
        versions=field("version"),
        groups=field("group"),
        nbytes=nbytes,
        deadline=float(field("deadline")[:1].view(np.float64).sum()),  # one claim's
        dp_rank=int(field("dp_rank")[:1].sum()),
    )


def _bookkeeping(dp: Any) -> tuple[np.ndarray, np.ndarray] | None:
    batch = getattr(dp, "batch", None)
    objects = getattr(dp, "non_tensor_batch", None) or {}
    if batch is None or ROWS_KEY not in set(batch.keys()) or TASK_KEY not in objects:
        return None
    rows = host(batch[ROWS_KEY])
    return rows, np.asarray(objects[TASK_KEY], dtype=object)
