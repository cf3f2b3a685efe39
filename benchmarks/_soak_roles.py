"""The processes ``benchmarks/soak.py`` starts, SIGKILLs and starts again: one role each.

``python benchmarks/_soak_roles.py ROLE SPEC_JSON``. Every role keeps its progress in an
append-only log (one ``os.write`` per line, so a SIGKILL loses no line that was written)
and, started again under the same name, resumes from it the way a real worker resumes
from its checkpoint:

- ``producer``: idempotent puts (``producer=name``, ``seq``) with up to ``window``
  ``put_async``s in flight; logs each answered ``seq`` in order. A restarted producer
  resumes after the last one and re-sends the ``window`` puts that may have been in
  flight (the hub drops those that had landed).
- ``churn``: the same, each put from a new short-lived thread; rounds of ``window``
  threads, all at once or one after another, alternately; logs each round.
- ``consumer``: claims, reads, checks each sample against its key, acks. Logs ``C``
  (claimed), ``P`` (the keys, about to ack), ``A`` (acked) or ``X`` (the lease had
  expired: not consumed). An ack whose outcome it could not see (a ``TransportError``,
  or its own death between ``P`` and ``A``) is sent again; a ``LeaseError`` before the
  lease's deadline then means the first one landed (a lease ends before its deadline
  only by its ack), after it the outcome is unknown: ``U``.
- ``publisher``: publishes weight versions whose every element equals the version, and
  announces each to the hub; logs each version.
- ``subscriber``: polls the channel, checks every element of each snapshot it reads
  (a torn read mixes versions), logs ``V version bad``.

The sample data is a function of its key, so whoever reads a sample can check it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

#: A sample's key: producer index, put sequence number, position in the put.
_SEQ_SHIFT, _POS_SHIFT = 40, 8
#: One key in ``BIG_EVERY`` has ``BIG_TOKENS`` tokens: its put's buffers go through the
#: storage units' shared-memory arenas (``SHM_MIN_BYTES``).
BIG_EVERY, BIG_TOKENS = 61, 9000
#: A consumer keeps the data of its last ``HELD`` batches and checks it again after every
#: read: an array from ``get`` must never change, however long it is kept, while the units
#: reuse the shared memory of evicted samples for new puts.
HELD = 4


def keys_of(producer: int, seq: int, batch: int) -> list[int]:
    """The keys of ``producer``'s put number ``seq`` (1..``batch`` samples)."""
    size = 1 + (producer * 7919 + seq * 104729) % batch
    return [(producer << _SEQ_SHIFT) | (seq << _POS_SHIFT) | i for i in range(size)]


def tokens_of(key: int) -> int:
    return BIG_TOKENS if key % BIG_EVERY == 0 else 1 + key % 7


def rows(keys: list[int]) -> dict[str, Any]:
    """The columns of the samples with these keys (what a reader checks it got)."""
    return {
        "key": np.array(keys, dtype=np.int64),
        "ids": [np.arange(tokens_of(k), dtype=np.int64) + k for k in keys],
        "reward": np.array([k % 1000 for k in keys], dtype=np.float32),
    }


def mismatches(batch: Any) -> int:
    """How many samples of ``batch`` hold data that is not their key's."""
    keys = batch.numpy("key").tolist()
    ids = batch["ids"]
    rewards = batch.numpy("reward").tolist() if "reward" in batch else None
    bad = 0
    for pos, key in enumerate(keys):
        seq = np.asarray(ids[pos])
        good = seq.size == tokens_of(key) and bool((seq == np.arange(seq.size) + key).all())
        if rewards is not None and rewards[pos] != float(np.float32(key % 1000)):
            good = False
        bad += not good
    return bad


# -- logs ------------------------------------------------------------------------------------
class Log:
    """An append-only progress log; a line is one ``os.write`` (a SIGKILL loses none that
    returned). ``lines`` are the complete lines already there."""

    def __init__(self, path: str) -> None:
        self.lines = read_log(path)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, *fields: object) -> None:
        os.write(self._fd, (" ".join(map(str, fields)) + "\n").encode())


def read_log(path: str) -> list[list[str]]:
    """The complete lines of a log, split in fields (a torn last line is left out)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    return [line.split() for line in text.split("\n")[:-1] if line]


def _stopping(spec: dict[str, Any]) -> bool:
    return os.path.exists(spec["stop"])


def _connect(spec: dict[str, Any]) -> Any:
    import flowrl

    hub = flowrl.connect(spec["address"])
    hub.rpc_timeout = spec["rpc_timeout"]
    return hub


# -- producers ------------------------------------------------------------------------------
def produce(spec: dict[str, Any]) -> None:
    from flowrl.errors import FlowRLError

    hub, log = _connect(spec), Log(spec["log"])
    index, name, window, batch = spec["index"], spec["name"], spec["window"], spec["batch"]
    seq = int(log.lines[-1][0]) + 1 if log.lines else 0
    resend_until = seq + window  # the puts a killed predecessor may have had in flight
    pending: collections.deque[tuple[int, Any]] = collections.deque()
    while True:
        try:
            while len(pending) < window and (seq < resend_until or not _stopping(spec)):
                data = rows(keys_of(index, seq, batch))
                put = hub.put_async(data, producer=name, seq=seq, timeout=spec["put_timeout"])
                pending.append((seq, put))
                seq += 1
            if not pending:
                break
            oldest, put = pending[0]
            put.result()
            pending.popleft()
            log.write(oldest)
            time.sleep(spec["pause"])
        except FlowRLError:  # a put refused or unanswered: send it (and those after) again
            with contextlib.suppress(FlowRLError):
                hub.flush(spec["rpc_timeout"])  # (collects the other failures)
            # unanswered puts may have landed: they are sent until answered, stop or not
            resend_until = max(resend_until, seq)
            seq = pending[0][0] if pending else seq
            pending.clear()
            time.sleep(0.1)
    hub.close()


def churn(spec: dict[str, Any]) -> None:
    """Puts from short-lived threads, ``window`` per round: together, then one by one."""
    from flowrl.errors import FlowRLError

    hub, log = _connect(spec), Log(spec["log"])
    index, name, window, batch = spec["index"], spec["name"], spec["window"], spec["batch"]
    rounds = len(log.lines)
    seq = int(log.lines[-1][1]) + 1 if log.lines else 0
    first = True  # a killed predecessor's last round may have been in flight: send it again

    def put_one(s: int) -> None:
        while True:
            try:
                hub.put(rows(keys_of(index, s, batch)), producer=name, seq=s, timeout=2.0)
                return
            except FlowRLError:
                time.sleep(0.1)

    while first or not _stopping(spec):
        threads = [threading.Thread(target=put_one, args=(s,)) for s in range(seq, seq + window)]
        if rounds % 2 == 0:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for t in threads:
                t.start()
                t.join()
        log.write(seq, seq + window - 1)
        seq += window
        rounds += 1
        first = False
        time.sleep(spec["pause"])
    hub.close()


# -- consumers ------------------------------------------------------------------------------
def consume(spec: dict[str, Any]) -> None:
    from flowrl.errors import EndOfStream, FlowRLError, LeaseError, TransportError

    hub, log = _connect(spec), Log(spec["log"])
    task, batch = spec["task"], spec["batch"]
    _settle_predecessor(hub, log, task)
    held: collections.deque[Any] = collections.deque(maxlen=HELD)
    while True:
        try:
            meta = hub.claim(task, batch, min_n=1, timeout=spec["claim_timeout"])
        except EndOfStream:
            break
        except FlowRLError:
            time.sleep(0.05)  # nothing ready, or the controller restarting: claim again
            continue
        log.write("C", meta.lease, repr(meta.deadline))
        try:
            data = retry(lambda m=meta: hub.get(m), meta.deadline)
        except FlowRLError:
            continue  # not read in time: the lease expires, the samples come back
        keys = data.numpy("key").tolist()
        bad = mismatches(data)
        for kept in list(held):
            changed = mismatches(kept)
            if changed:  # counted once: the batch is let go
                bad += changed
                held.remove(kept)
        if bad:
            log.write("Z", meta.lease, bad)
        held.append(data)
        log.write("P", meta.lease, ",".join(map(str, keys)))
        try:
            hub.ack(meta)
            log.write("A", meta.lease)
        except LeaseError:
            log.write("X", meta.lease)  # expired first: delivered again, not consumed here
        except TransportError:
            log.write(_ack_again(hub, task, meta.lease, meta.deadline), meta.lease)
    hub.close()


def retry(call: Callable[[], Any], until: float) -> Any:
    """``call()``, again after each ``TransportError`` (a server restarting) until the
    wall-clock time ``until``."""
    from flowrl.errors import TransportError

    while True:
        try:
            return call()
        except TransportError:
            if time.time() > until:
                raise
            time.sleep(0.1)


def _handle(task: str, lease: int, deadline: float) -> Any:
    """A handle to ack or release a lease by its id (what an ack sends: task and lease)."""
    import flowrl

    empty = np.zeros(0, dtype=np.int64)
    return flowrl.BatchMeta(
        task=task,
        lease=lease,
        columns=(),
        indices=empty,
        units=empty.astype(np.int16),
        tokens=empty,
        versions=empty,
        groups=empty,
        nbytes=0,
        deadline=deadline,
    )


def _ack_again(hub: Any, task: str, lease: int, deadline: float) -> str:
    """Ack a lease whose earlier ack may or may not have landed: ``A`` (it is acked now,
    or was), ``U`` (its deadline passed: it may have expired instead)."""
    from flowrl.errors import LeaseError, TransportError

    while True:
        asked = time.time()
        try:
            hub.ack(_handle(task, lease, deadline))
            return "A"
        except LeaseError:
            return "A" if asked < deadline else "U"  # before it: settled, i.e. acked
        except TransportError:
            if time.time() > deadline + 30:
                return "U"
            time.sleep(0.1)


def _settle_predecessor(hub: Any, log: Log, task: str) -> None:
    """A killed predecessor's last lease: ack it again if it was about to ack (``P``),
    give it back if it had only claimed it (``C``: not consumed, ``X``)."""
    from flowrl.errors import FlowRLError

    last: list[str] = []
    about_to_ack = False
    for fields in log.lines:
        if fields[0] == "C":
            last, about_to_ack = fields, False
        elif fields[0] == "P":
            about_to_ack = True
        elif fields[0] in ("A", "U", "X"):
            last = []
    if not last:
        return
    lease, deadline = int(last[1]), float(last[2])
    if about_to_ack:
        log.write(_ack_again(hub, task, lease, deadline), lease)
        return
    with contextlib.suppress(FlowRLError):  # expired already: nothing to give back
        hub.release(_handle(task, lease, deadline))
    log.write("X", lease)


# -- weights --------------------------------------------------------------------------------
def _weights(version: int, elements: int) -> list[tuple[str, Any]]:
    import torch

    half = elements // 2
    return [
        ("embed", torch.full((half,), float(version))),
        ("head", torch.full((elements - half,), float(version))),
    ]


def publish(spec: dict[str, Any]) -> None:
    import flowrl
    from flowrl.errors import FlowRLError

    hub, log = _connect(spec), Log(spec["log"])
    version = int(log.lines[-1][0]) + 1 if log.lines else 1
    publisher = flowrl.WeightPublisher(spec["channel"])
    while not _stopping(spec):
        publisher.publish(_weights(version, spec["elements"]), version)
        log.write(version)
        with contextlib.suppress(FlowRLError):  # the controller restarting: the next one
            hub.publish_version(version)
        version += 1
        time.sleep(spec["pause"])
    publisher.close()
    hub.close()


def subscribe(spec: dict[str, Any]) -> None:
    import flowrl
    from flowrl.errors import TransportError

    log = Log(spec["log"])
    subscriber = flowrl.WeightSubscriber(spec["channel"], wait_s=5.0)
    have = None
    while not _stopping(spec):
        try:
            snapshot = subscriber.poll(have)
        except TransportError:  # the publisher died holding its lock: poll again
            snapshot = None
        if snapshot is not None:
            bad = sum(int((t != snapshot.version).sum()) for _, t in snapshot.tensors())
            log.write("V", snapshot.version, bad)
            have = snapshot.version
            snapshot.release()
        time.sleep(spec["pause"])
    subscriber.close()


ROLES: dict[str, Callable[[dict[str, Any]], None]] = {
    "producer": produce,
    "churn": churn,
    "consumer": consume,
    "publisher": publish,
    "subscriber": subscribe,
}


def consumer_records(lines: list[list[str]]) -> Iterator[tuple[str, int, list[int]]]:
    """``(outcome, lease, keys)`` of each lease a consumer's log settled: outcome ``A``,
    ``U`` or ``X``; ``keys`` those its ``P`` line read (empty without one)."""
    keys: dict[int, list[int]] = {}
    for fields in lines:
        kind, lease = fields[0], int(fields[1])
        if kind == "P":
            keys[lease] = [int(k) for k in fields[2].split(",")] if len(fields) > 2 else []
        elif kind in ("A", "U", "X"):
            yield kind, lease, keys.pop(lease, [])


def consumed_keys(records: Iterable[tuple[str, int, list[int]]]) -> list[int]:
    """The keys one task consumed, from its consumers' settled leases: those acked
    (``A``), and those of an unresolved ack (``U``) unless acked again elsewhere (then
    its lease had expired first). Exact without ``U``; each ``U`` is a lease for which a
    loss or a duplicate by the hub would go unseen."""
    acked: list[int] = []
    unresolved: list[int] = []
    for outcome, _, keys in records:
        if outcome == "A":
            acked += keys
        elif outcome == "U":
            unresolved += keys
    seen = set(acked)
    return acked + [k for k in unresolved if k not in seen]


if __name__ == "__main__":
    ROLES[sys.argv[1]](json.loads(sys.argv[2]))
