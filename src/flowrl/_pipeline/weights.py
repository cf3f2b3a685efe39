"""Weight sync: the trainer publishes versioned weights, rollout engines load them.

In one process, :class:`WeightStore` keeps one set of shared tensors: ``publish`` copies
the trainer's parameters into them under a lock and returns the new version, which the
trainer then announces with ``hub.publish_version`` (a ``VersionPublished`` event);
``pull`` copies them into a worker's model only when the version moved.

Across processes on one machine, :class:`WeightPublisher` writes each version's tensors
into a fresh shared-memory *segment* (a file under ``/dev/shm``: the tensors back to back,
64-byte aligned) and then replaces a small *header* file (a msgspec-encoded
:class:`WeightHeader`: version, segment, and each tensor's name, dtype, shape and offset)
with an atomic rename. A :class:`WeightSubscriber` polls the header (one ``stat``, a read
when it changed), maps the segment read-only and hands out tensors built over the mapping
without a copy; the rollout engine copies them into its model between decoding steps
(``RolloutEngine.update_weights``), so the stream never stops. A segment's bytes are never
rewritten: the publisher unlinks segments older than the last ``keep``, and a subscriber
that mapped one keeps reading the same bytes (Linux keeps an unlinked file's pages while
mapped). Cost: one copy in (trainer), one copy out (rollout), no serialisation.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple, final

import msgspec

from flowrl.errors import ConfigError, TransportError

if TYPE_CHECKING:  # torch is imported lazily: hub servers import flowrl without it
    import torch

__all__ = [
    "WeightHeader",
    "WeightPublisher",
    "WeightStore",
    "WeightSubscriber",
    "load_named",
    "module_weights",
]

_FOLDER = "/dev/shm"
_PREFIX = "flowrl-weights-"
_ALIGN = 64
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


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
    """One tensor of a segment: its bytes are ``[offset, offset + nbytes)``."""

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


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(WeightHeader)


def _check_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ConfigError(
            f"weight channel name expects letters, digits, '-' and '_', got {name!r}; "
            "use e.g. the run's name"
        )


def _header_path(name: str, folder: str) -> str:
    return os.path.join(folder, f"{_PREFIX}{name}.header")


class _Spare(NamedTuple):
    """A segment made ahead of the next publish: allocated and mapped, not yet written."""

    path: str
    size: int
    mem: mmap.mmap


@final
class WeightPublisher:
    """Publishes versions of named tensors to subscribers on this machine (module
    docstring). ``name``: the channel (one per trainer); ``keep``: segments kept besides
    the newest, for subscribers still opening them.

    After each publish a background thread allocates and maps the next segment (of the
    same size), so the next publish is one copy into memory whose pages already exist:
    on a loaded machine, faulting in fresh pages costs several times the copy itself.
    The price is one spare segment of the model's size in ``/dev/shm``.
    """

    def __init__(self, name: str, *, keep: int = 1, folder: str = _FOLDER) -> None:
        _check_name(name)
        if keep < 0:
            raise ConfigError(f"WeightPublisher keep expects >= 0 older segments, got {keep}")
        if not os.path.isdir(folder):
            raise ConfigError(f"WeightPublisher needs the shared-memory folder {folder!r}")
        self.name = name
        self._folder = folder
        self._keep = keep
        self._token = secrets.token_hex(4)
        self._count = 0
        self._segments: list[str] = []
        self._spare: _Spare | None = None
        self._preparing: threading.Thread | None = None
        self.version: int | None = None

    def publish(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightHeader:
        """Write ``version``'s tensors to a new segment, then point the header at it."""
        if self.version is not None and version <= self.version:
            raise ConfigError(
                f"WeightPublisher.publish: version {version} is not newer than the published "
                f"{self.version}; versions must increase"
            )
        tensors = [(n, t.detach().cpu().contiguous()) for n, t in weights]
        entries, offset = [], 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            dtype = str(t.dtype).removeprefix("torch.")
            entries.append(TensorEntry(name, dtype, tuple(t.shape), offset, nbytes))
            offset = -(-(offset + nbytes) // _ALIGN) * _ALIGN
        size = max(offset, 1)
        segment = self._take_segment(size)
        try:
            _copy_in(segment.mem, tensors, entries)
        except BaseException:
            os.unlink(segment.path)
            raise
        finally:
            segment.mem.close()
        header = WeightHeader(version, segment.path, tuple(entries))
        path = _header_path(self.name, self._folder)
        tmp = f"{path}.{self._token}.tmp"
        with open(tmp, "wb") as f:
            f.write(_ENCODER.encode(header))
        os.replace(tmp, path)  # atomic: a subscriber reads the old header or the new one
        self.version = version
        self._segments.append(segment.path)
        while len(self._segments) > self._keep + 1:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._segments.pop(0))
        self._preparing = threading.Thread(target=self._prepare, args=(size,), daemon=True)
        self._preparing.start()
        return header

    def close(self) -> None:
        """Remove the header, every segment of this publisher and its spare."""
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        if self._spare is not None:
            self._spare.mem.close()
            self._segments.append(self._spare.path)
            self._spare = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_header_path(self.name, self._folder))
        for segment in self._segments:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment)
        self._segments.clear()

    def _take_segment(self, size: int) -> _Spare:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        spare, self._spare = self._spare, None
        if spare is not None and spare.size == size:
            return spare
        if spare is not None:  # the tensors changed size: a fresh one
            spare.mem.close()
            os.unlink(spare.path)
        return self._new_segment(size)

    def _prepare(self, size: int) -> None:
        with contextlib.suppress(OSError):  # no room: the next publish allocates then
            self._spare = self._new_segment(size)

    def _new_segment(self, size: int) -> _Spare:
        self._count += 1
        path = os.path.join(self._folder, f"{_PREFIX}{self.name}-{self._token}-{self._count}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on a later write
            mem = mmap.mmap(fd, size, flags=_MAP_FLAGS)  # pages mapped in bulk
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return _Spare(path, size, mem)


def _copy_in(
    mem: mmap.mmap, tensors: list[tuple[str, torch.Tensor]], entries: list[TensorEntry]
) -> None:
    import torch

    for (_, t), e in zip(tensors, entries, strict=True):
        if e.nbytes:
            dst = torch.frombuffer(mem, dtype=t.dtype, count=t.numel(), offset=e.offset)
            dst.copy_(t.reshape(-1))
            del dst  # the mapping closes only when no tensor exports it


@final
class WeightSnapshot:
    """One published version, mapped read-only: :meth:`tensors` are views of the segment."""

    def __init__(self, header: WeightHeader, mem: mmap.mmap) -> None:
        self.version = header.version
        self._header = header
        self._mem = mem

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` in published order; the tensors share the mapping (copy them
        to keep them past the next version)."""
        import torch

        for e in self._header.tensors:
            dtype = getattr(torch, e.dtype)
            count = e.nbytes // torch.empty(0, dtype=dtype).element_size()
            if count == 0:
                yield e.name, torch.empty(e.shape, dtype=dtype)
                continue
            flat = torch.frombuffer(self._mem, dtype=dtype, count=count, offset=e.offset)
            yield e.name, flat.view(e.shape)


@final
class WeightSubscriber:
    """Notices and maps the versions a :class:`WeightPublisher` of ``name`` publishes."""

    def __init__(self, name: str, *, folder: str = _FOLDER) -> None:
        _check_name(name)
        self.name = name
        self._path = _header_path(name, folder)

    def poll(self, have: int | None = None) -> WeightSnapshot | None:
        """The newest published version if it is newer than ``have`` (any, when None),
        else None. One small file read: cheap enough to call between decoding steps."""
        for _ in range(3):  # the segment named may be unlinked by a newer publish: reread
            try:
                with open(self._path, "rb") as f:
                    header = _DECODER.decode(f.read())
                if have is not None and header.version <= have:
                    return None
                return WeightSnapshot(header, _map(header.segment))
            except FileNotFoundError:
                if not os.path.exists(self._path):
                    return None  # nothing published yet
        raise TransportError(
            f"weight channel {self.name!r}: the published segments disappeared while being "
            "opened three times; raise the publisher's keep"
        )


def _map(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)  # private: torch wants writable
    finally:
        os.close(fd)
