"""Weight sync: the trainer publishes versioned weights, rollout engines load them.

In one process, :class:`WeightStore` keeps one set of shared tensors: ``publish`` copies
the trainer's parameters into them under a lock and returns the new version, which the
trainer then announces with ``hub.publish_version`` (a ``VersionPublished`` event);
``pull`` copies them into a worker's model only when the version moved.

Across processes, a *publisher* and its *subscribers* share one interface
(:class:`BaseWeightPublisher`, :class:`BaseWeightSubscriber`, :class:`WeightSnapshot`):
``publish(weights, version)`` (or ``publish_async``), ``poll(have)`` for a snapshot of
the newest version, ``snapshot.tensors()`` views to copy from and ``snapshot.release()``;
``subscriber.sync(engine)`` does all of it between two decoding steps of a rollout
engine (``RolloutEngine.update_weights``), so the stream never stops. Two transports:

- shared memory on one machine (:class:`WeightPublisher`, :class:`WeightSubscriber`,
  here): the publisher owns a small pool of *arenas*, files under ``/dev/shm`` made and
  mapped once (their pages faulted in once: fresh pages cost several times a copy on a
  loaded machine) and reused for every version. A version's tensors are written straight
  into a free arena (cast to a transfer dtype on the way when one is set), 64-byte
  aligned, then a small *header* file (a msgspec-encoded :class:`WeightHeader`: version,
  arena, each tensor's name, dtype, shape and offset) is replaced with an atomic rename.
  Subscribers keep each arena mapped read-only, so a load is one copy from memory whose
  pages are already mapped.
- the Ray object store on a cluster (:mod:`flowrl._weights.object_store`).

The channel's files are private to the user and a restarted publisher removes what a
killed one left behind (:mod:`flowrl._weights.shm_files`).

Torn-read safety (shared memory): an arena is ``flock``-ed exclusively while a version
is written into it and shared while a subscriber reads it. The publisher writes only
into an arena that is not the newest and that it can lock at once (it adds an arena, up
to ``max_arenas``, when every other one is being read); a subscriber locks the arena the
header names and rereads the header: if it still names that arena, the arena holds that
complete version, and no publisher can rewrite it until the snapshot is released.
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import mmap
import os
import secrets
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol, final

import msgspec

from flowrl._weights.shm_files import ChannelFiles, open_private
from flowrl.errors import ConfigError, TransportError

if TYPE_CHECKING:  # torch is imported lazily: hub servers import flowrl without it
    import torch

__all__ = [
    "BaseWeightPublisher",
    "BaseWeightSubscriber",
    "TensorEntry",
    "WeightHeader",
    "WeightPublisher",
    "WeightSnapshot",
    "WeightStore",
    "WeightSubscriber",
    "layout",
    "load_named",
    "module_weights",
    "typed",
]

_FOLDER = "/dev/shm"
_ALIGN = 64
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map every page at once, not one fault each
_LOCK_RETRY_S = 0.001


def module_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s parameters (a tied tensor once, under its first name) and persistent
    buffers, detached: what a weight sync sends."""
    yield from ((n, p.detach()) for n, p in module.named_parameters())
    skip = {
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        for name in getattr(sub, "_non_persistent_buffers_set", ())
    }
    yield from ((n, b.detach()) for n, b in module.named_buffers() if n not in skip)


def load_named(module: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy named tensors into ``module``'s parameters and buffers (a tied parameter under
    any of its names); returns how many were loaded. Unknown names and shape mismatches
    raise before the module changes only where they come first; validate the source."""
    import torch

    targets: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    targets.update(module.named_buffers(remove_duplicate=False))
    n = 0
    with torch.no_grad():
        for name, tensor in weights:
            target = targets.get(name)
            if target is None or target.shape != tensor.shape:
                got = "no such tensor" if target is None else f"shape {tuple(target.shape)}"
                raise ConfigError(
                    f"weight {name!r} of shape {tuple(tensor.shape)} does not fit the model "
                    f"({got}); sync between models of one architecture"
                )
            target.copy_(tensor)
            n += 1
    return n


@final
class WeightStore:
    """Versioned weights shared by a trainer and the workers that sample with them.

    It holds the named tensors :func:`module_weights` gives (a tied tensor once) and loads
    them into a worker's model with :func:`load_named`; :meth:`publish_weights` takes named
    tensors from anywhere, e.g. an update engine's ``named_weights()``.
    """

    def __init__(self, model: torch.nn.Module, *, version: int = 0) -> None:
        self._lock = threading.Lock()
        self._tensors = {k: v.clone() for k, v in module_weights(model)}
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    def publish(self, model: torch.nn.Module, version: int | None = None) -> int:
        """Copy ``model``'s weights in as the next (or the given) version; returns it."""
        return self.publish_weights(module_weights(model), version)

    def publish_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> int:
        """Copy named tensors (every one the store holds) in as the next (or the given)
        version; returns it."""
        named = dict(weights)
        if named.keys() != self._tensors.keys():
            odd = sorted(named.keys() ^ self._tensors.keys())
            raise ConfigError(
                f"WeightStore.publish: the weights differ from the ones the store was built "
                f"with (names {odd[:4]} are in one and not the other); publish the same "
                "architecture"
            )
        import torch

        with self._lock, torch.no_grad():
            for name, tensor in named.items():
                self._tensors[name].copy_(tensor)
            self._version = self._version + 1 if version is None else version
            return self._version

    def pull(self, model: torch.nn.Module, have: int) -> int:
        """Load the latest weights into ``model`` if newer than version ``have``."""
        if self._version == have:
            return have
        with self._lock:
            load_named(model, self._tensors.items())
            return self._version

    def newer(self, have: int) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """The latest version and a copy of its tensors if it is not ``have``, else None
        (for a rollout engine's ``update_weights``)."""
        if self._version == have:
            return None
        with self._lock:
            return self._version, [(n, t.clone()) for n, t in self._tensors.items()]


class TensorEntry(msgspec.Struct, frozen=True, array_like=True):
    """One tensor of a published version: its bytes are ``[offset, offset + nbytes)`` of
    the version's buffer, in ``dtype`` (the transfer dtype, when the publisher has one)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@final
class WeightHeader(msgspec.Struct, frozen=True, tag="weights"):
    """What a subscriber reads first: the version and where its tensors lie."""

    version: int
    segment: str
    tensors: tuple[TensorEntry, ...]


def layout(
    tensors: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> tuple[list[TensorEntry], int]:
    """Where each tensor goes in one buffer (back to back, 64-byte aligned) and the
    buffer's size; floating-point tensors take ``dtype`` when it is given."""
    entries, offset = [], 0
    for name, t in tensors:
        out = dtype if dtype is not None and t.is_floating_point() else t.dtype
        nbytes = t.numel() * out.itemsize
        entries.append(
            TensorEntry(name, str(out).removeprefix("torch."), tuple(t.shape), offset, nbytes)
        )
        offset = -(-(offset + nbytes) // _ALIGN) * _ALIGN
    return entries, offset


def _copy_in(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    entries: list[TensorEntry],
    from_gpu: _DeviceToHost | None = None,
) -> None:
    """Write each tensor into its place of the uint8 buffer ``flat``, casting on the way;
    GPU tensors through ``from_gpu`` when it is given."""
    import torch

    with torch.no_grad():
        for t, e in zip(tensors, entries, strict=True):
            if not e.nbytes:
                continue
            if from_gpu is not None and t.is_cuda:
                out = getattr(torch, e.dtype)
                src = t.detach().to(out).contiguous().reshape(-1).view(torch.uint8)
                from_gpu.copy(flat[e.offset : e.offset + e.nbytes], src)
            else:
                _view(flat, e).copy_(t)


class _DeviceToHost:
    """Copies GPU bytes into host memory through two reused page-locked buffers. A copy
    from a GPU into pageable memory (a shared-memory arena) is staged by the driver
    through its own bounce buffer; into page-locked memory it runs at the bus's speed,
    and the next chunk's transfer overlaps this chunk's copy into place (measured on an
    H200 host, 1 GiB of bf16: 18.97 GiB/s this way, 13.2 GiB/s copied straight in)."""

    CHUNK = 64 << 20

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        """``dest[:] = src``: ``dest`` a uint8 host tensor, ``src`` a uint8 GPU tensor."""
        import torch

        if not self._buffers:
            self._buffers = [
                torch.empty(self.CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2)
            ]
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
        pending: tuple[int, torch.Tensor, torch.Tensor] | None = None
        with torch.cuda.device(src.device):
            for k, start in enumerate(range(0, src.numel(), self.CHUNK)):
                end = min(start + self.CHUNK, src.numel())
                slot = k % 2
                staged = self._buffers[slot][: end - start]
                staged.copy_(src[start:end], non_blocking=True)
                self._events[slot].record()
                if pending is not None:
                    self._finish(*pending)
                pending = (slot, dest[start:end], staged)
            if pending is not None:
                self._finish(*pending)

    def _finish(self, slot: int, dest: torch.Tensor, staged: torch.Tensor) -> None:
        self._events[slot].synchronize()
        dest.copy_(staged)


def _view(flat: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """``entry``'s tensor over the uint8 buffer ``flat``, without a copy."""
    return typed(flat[entry.offset : entry.offset + entry.nbytes], entry)


def typed(data: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """``entry``'s tensor over its own bytes (a uint8 tensor of ``entry.nbytes``)."""
    import torch

    dtype = getattr(torch, entry.dtype)
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    return data.view(dtype).view(entry.shape)


def _transfer_dtype(dtype: torch.dtype | None, who: str) -> torch.dtype | None:
    import torch

    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(
            f"{who} dtype expects a floating torch.dtype (e.g. torch.bfloat16, what the "
            f"rollout engine runs in) or None (send as they are), got {dtype!r}"
        )
    return dtype


def _named_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], who: str
) -> list[tuple[str, torch.Tensor]]:
    import torch

    named = []
    for item in weights:
        name, tensor = item if isinstance(item, tuple) and len(item) == 2 else (None, None)
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ConfigError(
                f"{who}.publish expects (name, tensor) pairs, e.g. model.named_parameters(), "
                f"got {type(item).__name__} {str(item)[:60]!r}"
            )
        named.append((name, tensor.detach()))
    return named


class _LoadsWeights(Protocol):
    """What :meth:`BaseWeightSubscriber.sync` needs of a rollout engine."""

    @property
    def version(self) -> int: ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> int: ...


class WeightSnapshot(abc.ABC):
    """One published version as a subscriber holds it: ``version`` and :meth:`tensors`,
    views of the transport's memory that stay valid (and unchanged) until
    :meth:`release` or the subscriber's next ``poll``. A context manager releases it."""

    def __init__(self, version: int, entries: Sequence[TensorEntry]) -> None:
        self.version = version
        self._entries = entries
        self._released = False

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` in published order, read-only views without a copy: copy
        them (``param.copy_``, ``update_weights``) to keep them past :meth:`release`."""
        if self._released:
            raise TransportError(
                f"weight snapshot of version {self.version} was released (by release() or "
                "the next poll()); poll again for the newest version"
            )
        for i, e in enumerate(self._entries):
            yield e.name, self._tensor(i, e)

    def release(self) -> None:
        """Let the publisher reuse this version's memory; idempotent."""
        if not self._released:
            self._released = True
            self._release()

    @abc.abstractmethod
    def _tensor(self, index: int, entry: TensorEntry) -> torch.Tensor: ...

    @abc.abstractmethod
    def _release(self) -> None: ...

    def __enter__(self) -> WeightSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class BaseWeightPublisher(abc.ABC):
    """Publishes increasing versions of named tensors to subscribers (module docstring).

    Subclasses implement :meth:`_write` (the tensors are detached, their layout computed
    in the transfer dtype) and :meth:`_close`.
    """

    def __init__(self, *, dtype: torch.dtype | None) -> None:
        self.dtype = _transfer_dtype(dtype, type(self).__name__)
        #: the newest version written (``None`` before the first)
        self.version: int | None = None
        self._claimed: int | None = None
        self._claim_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def publish(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write ``version``'s named tensors, then make it the newest; returns when
        subscribers can see it."""
        tensors = self._claim(weights, version)
        self._publish(tensors, version)

    def publish_async(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> Future[None]:
        """:meth:`publish` in a background thread, so the trainer is not held: the
        tensors must not change until the future is done (wait for it before the next
        optimizer step). Versions are checked here, at once; errors come from the future."""
        tensors = self._claim(weights, version)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="flowrl-weights")
        return self._executor.submit(self._publish, tensors, version)

    def close(self) -> None:
        """Wait for an asynchronous publish, then free what the publisher holds."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        with self._write_lock:
            self._close()

    def _claim(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> list[tuple[str, torch.Tensor]]:
        with self._claim_lock:
            if self._claimed is not None and version <= self._claimed:
                raise ConfigError(
                    f"{type(self).__name__}.publish: version {version} is not newer than the "
                    f"published {self._claimed}; versions must increase"
                )
            tensors = _named_tensors(weights, type(self).__name__)
            self._claimed = version
        return tensors

    def _publish(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        entries, size = layout(tensors, self.dtype)
        with self._write_lock:
            try:
                self._write([t for _, t in tensors], entries, size, version)
            except BaseException:
                with self._claim_lock:  # the version was not published: it may be retried
                    self._claimed = self.version
                raise
            self.version = version

    @abc.abstractmethod
    def _write(
        self, tensors: list[torch.Tensor], entries: list[TensorEntry], size: int, version: int
    ) -> None: ...

    @abc.abstractmethod
    def _close(self) -> None: ...


class BaseWeightSubscriber(abc.ABC):
    """Finds the newest version a publisher of the same channel published. A subscriber
    holds at most one snapshot: :meth:`poll` releases the previous one first."""

    def __init__(self) -> None:
        self._held: WeightSnapshot | None = None

    def poll(self, have: int | None = None) -> WeightSnapshot | None:
        """The newest published version if it is newer than ``have`` (any, when None),
        else None; cheap enough to call between decoding steps."""
        self.release()
        self._held = self._poll(have)
        return self._held

    def sync(self, engine: _LoadsWeights) -> bool:
        """Load the newest version into a rollout engine if it is newer than the engine's
        (``engine.update_weights``: running requests resume under it); returns whether
        it loaded one."""
        snapshot = self.poll(engine.version)
        if snapshot is None:
            return False
        try:
            engine.update_weights(snapshot.tensors(), snapshot.version)
        finally:
            snapshot.release()
        return True

    def release(self) -> None:
        """Release the snapshot the last :meth:`poll` returned, if any."""
        held, self._held = self._held, None
        if held is not None:
            held.release()

    def close(self) -> None:
        """Release the held snapshot and what the subscriber maps or references."""
        self.release()
        self._close()

    @abc.abstractmethod
    def _poll(self, have: int | None) -> WeightSnapshot | None: ...

    def _close(self) -> None:  # noqa: B027 (a subscriber without resources needs nothing)
        """Free the transport's resources."""


def _check_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ConfigError(
            f"weight channel name expects letters, digits, '-' and '_', got {name!r}; "
            "use e.g. the run's name"
        )


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(WeightHeader)


def _read_header(files: ChannelFiles) -> WeightHeader | None:
    """The channel's header (None: nothing published); a header that is not this user's,
    is not one, or names a file outside the channel raises :class:`TransportError`."""
    fd = open_private(files.header, os.O_RDONLY, what="header")
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    try:
        header = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise TransportError(
            f"weight channel header {files.header!r} is malformed ({exc}); remove it"
        ) from None
    if not files.is_arena(header.segment):
        raise TransportError(
            f"weight channel header {files.header!r} names {header.segment!r}, expected an "
            f"arena of channel {files.name!r} ({files.base}.<token>-<n>.arena); remove it"
        )
    return header


def _check_entries(header: WeightHeader, size: int, path: str) -> None:
    """Every tensor the header lists lies inside the arena, in a dtype torch knows."""
    import torch

    for e in header.tensors:
        dtype = getattr(torch, e.dtype, None)
        count = 1
        for d in e.shape:
            count *= d
        if (
            not isinstance(dtype, torch.dtype)
            or min(e.shape, default=0) < 0
            or e.offset < 0
            or e.nbytes != count * dtype.itemsize
            or e.offset + e.nbytes > size
        ):
            raise TransportError(
                f"weight channel header names tensor {e.name!r} as {e.dtype} {e.shape} at "
                f"[{e.offset}, +{e.nbytes}), which does not fit the {size}-byte arena "
                f"{path!r}; the header is malformed: remove it"
            )


@final
class _Arena:
    """A shared-memory file mapped once, with a uint8 tensor over the whole mapping."""

    def __init__(self, path: str, *, size: int | None) -> None:
        """``size`` given: create the file that large (the publisher's side, read-write);
        ``None``: open an existing one read-only (a subscriber's)."""
        import numpy as np
        import torch

        self.path = path
        writer = size is not None
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL if writer else os.O_RDONLY
        self.fd = open_private(path, flags, what="arena")
        try:
            if size is not None:
                os.posix_fallocate(self.fd, 0, size)  # ENOSPC now, not SIGBUS on a write
            self.size = os.fstat(self.fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writer else 0)
            self._mem = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | _POPULATE, prot=prot)
        except BaseException:
            os.close(self.fd)
            if writer:
                os.unlink(path)
            raise
        with warnings.catch_warnings():  # a subscriber's views are read-only by design
            warnings.simplefilter("ignore", UserWarning)
            self.flat = torch.from_numpy(np.frombuffer(self._mem, dtype=np.uint8))

    def try_lock(self, exclusive: bool) -> bool:
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self, *, unlink: bool = False) -> None:
        del self.flat
        with contextlib.suppress(BufferError):  # views still held: unmapped when they go
            self._mem.close()
        os.close(self.fd)
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


@final
class WeightPublisher(BaseWeightPublisher):
    """Publishes versions of named tensors to subscribers on this machine through shared
    memory (module docstring). ``name``: the channel (one per trainer); ``dtype``: the
    transfer dtype of floating-point tensors (e.g. ``torch.bfloat16`` when the rollout
    engine runs in it: half the bytes to write and read), ``None`` to send them as they
    are; ``max_arenas``: the pool's bound (each the size of one version): two suffice
    while subscribers release their snapshots, each subscriber holding one adds one.

    After the first publish a background thread makes the second arena, so no later
    publish waits for fresh pages. A publish that finds every arena held waits up to
    ``wait_s`` for a subscriber to release one, then raises :class:`TransportError`.
    """

    def __init__(
        self,
        name: str,
        *,
        dtype: torch.dtype | None = None,
        max_arenas: int = 4,
        wait_s: float = 60.0,
        folder: str = _FOLDER,
    ) -> None:
        _check_name(name)
        if max_arenas < 2:
            raise ConfigError(
                f"WeightPublisher max_arenas expects >= 2 (one read, one written), got {max_arenas}"
            )
        if not os.path.isdir(folder):
            raise ConfigError(f"WeightPublisher needs the shared-memory folder {folder!r}")
        super().__init__(dtype=dtype)
        self.name = name
        self._files = ChannelFiles(name, folder)
        self._max_arenas = max_arenas
        self._wait_s = wait_s
        self._token = secrets.token_hex(4)
        self._from_gpu = _DeviceToHost()
        self._count = 0
        self._arenas: list[_Arena] = []
        self._newest: _Arena | None = None
        self._preparing: threading.Thread | None = None
        self._lock_fd = self._files.lock_publisher()
        try:
            self._inherited = self._reclaim()
        except BaseException:
            self._files.unlock_publisher(self._lock_fd)
            raise

    def _reclaim(self) -> str | None:
        """Remove what a dead publisher of the channel left, but the arena of its newest
        version (returned), which subscribers read until this one publishes."""
        try:
            header = _read_header(self._files)
        except FileNotFoundError:
            header = None
        except TransportError:
            if os.stat(self._files.header, follow_symlinks=False).st_uid != os.geteuid():
                raise  # another user's: it cannot be replaced, so nothing can be published
            os.unlink(self._files.header)  # ours but unreadable: a version nobody can use
            header = None
        keep = None if header is None else header.segment
        self._files.sweep(keep)
        return keep

    @property
    def arenas(self) -> int:
        """Arenas made so far (each the size of one version)."""
        return len(self._arenas)

    def _write(
        self, tensors: list[torch.Tensor], entries: list[TensorEntry], size: int, version: int
    ) -> None:
        arena = self._free_arena(max(size, 1))
        try:
            _copy_in(arena.flat, tensors, entries, self._from_gpu)
            header = WeightHeader(version, arena.path, tuple(entries))
            tmp = self._files.tmp_header(self._token)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
            with os.fdopen(open_private(tmp, flags, what="header"), "wb") as f:
                f.write(_ENCODER.encode(header))
            os.replace(tmp, self._files.header)  # atomic: subscribers read old or new
            self._newest = arena
            self._drop_inherited()
        finally:
            arena.unlock()
        if len(self._arenas) < 2:
            self._preparing = threading.Thread(target=self._prepare, args=(arena.size,))
            self._preparing.start()

    def _free_arena(self, size: int) -> _Arena:
        """An arena of at least ``size`` bytes, locked exclusively, that is not the newest."""
        self._join_preparing()
        deadline = time.monotonic() + self._wait_s
        while True:
            for arena in list(self._arenas):
                if arena is self._newest or not arena.try_lock(exclusive=True):
                    continue
                if arena.size >= size:
                    return arena
                self._arenas.remove(arena)  # the tensors grew: make a larger one
                arena.close(unlink=True)
            if len(self._arenas) < self._max_arenas:
                arena = self._new_arena(size)
                arena.try_lock(exclusive=True)
                return arena
            if time.monotonic() > deadline:
                raise TransportError(
                    f"WeightPublisher {self.name!r}: all {self._max_arenas} arenas stayed held "
                    f"by subscribers for {self._wait_s} s; release snapshots (or use "
                    "subscriber.sync) or raise max_arenas"
                )
            time.sleep(_LOCK_RETRY_S)

    def _new_arena(self, size: int) -> _Arena:
        self._count += 1
        arena = _Arena(self._files.arena(self._token, self._count), size=size)
        self._arenas.append(arena)
        return arena

    def _prepare(self, size: int) -> None:
        with contextlib.suppress(OSError):  # no room: a later publish tries again
            self._new_arena(size)

    def _join_preparing(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    def _drop_inherited(self) -> None:
        if self._inherited is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._inherited)
            self._inherited = None

    def _close(self) -> None:
        self._join_preparing()
        if self._lock_fd < 0:
            return  # closed already
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._files.header)
        self._drop_inherited()
        for arena in self._arenas:
            arena.close(unlink=True)
        self._arenas.clear()
        self._newest = None
        self._files.unlock_publisher(self._lock_fd)
        self._lock_fd = -1


@final
class _ShmSnapshot(WeightSnapshot):
    def __init__(self, header: WeightHeader, arena: _Arena) -> None:
        super().__init__(header.version, header.tensors)
        self._arena = arena

    def _tensor(self, index: int, entry: TensorEntry) -> torch.Tensor:
        return _view(self._arena.flat, entry)

    def _release(self) -> None:
        self._arena.unlock()


@final
class WeightSubscriber(BaseWeightSubscriber):
    """Notices and maps the versions a :class:`WeightPublisher` of ``name`` publishes.
    Each arena is mapped once (read-only) and kept until :meth:`close`."""

    def __init__(self, name: str, *, folder: str = _FOLDER, wait_s: float = 10.0) -> None:
        _check_name(name)
        super().__init__()
        self.name = name
        self._files = ChannelFiles(name, folder)
        self._wait_s = wait_s
        self._arenas: dict[str, _Arena] = {}

    def _poll(self, have: int | None) -> WeightSnapshot | None:
        deadline = time.monotonic() + self._wait_s
        while time.monotonic() < deadline:
            header = self._header()
            if header is None or (have is not None and header.version <= have):
                return None
            arena = self._arena(header.segment)
            if arena is not None and arena.try_lock(exclusive=False):
                again = self._header()
                if again is not None and again.segment == header.segment:
                    try:
                        _check_entries(again, arena.size, arena.path)
                    except TransportError:
                        arena.unlock()
                        raise
                    return _ShmSnapshot(again, arena)  # complete, and kept so until release
                arena.unlock()
            time.sleep(_LOCK_RETRY_S)  # the header moved on meanwhile: read it again
        raise TransportError(
            f"weight channel {self.name!r}: could not lock the newest version's arena for "
            f"{self._wait_s} s; is the publisher alive?"
        )

    def _header(self) -> WeightHeader | None:
        try:
            return _read_header(self._files)
        except FileNotFoundError:
            return None  # nothing published yet, or the publisher closed

    def _arena(self, path: str) -> _Arena | None:
        arena = self._arenas.get(path)
        if arena is None:
            self._forget_removed()
            try:
                arena = self._arenas[path] = _Arena(path, size=None)
            except FileNotFoundError:
                return None  # replaced by a larger one meanwhile
        return arena

    def _forget_removed(self) -> None:
        for path in [p for p in self._arenas if not os.path.exists(p)]:
            self._arenas.pop(path).close()

    def _close(self) -> None:
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()
