"""Values between a session's kernel and its ranks through shared memory: a big tensor or array is
written once, and each reader maps it, copy-on-write, instead of unpickling it from a file or a socket.

Pickle protocol 5 separates a value's big buffers from the rest (numpy arrays give theirs; a
CPU tensor's storage is given the same way here). The rest is a small pickle; each big buffer goes
into a ``memfd`` (anonymous shared memory: no file in /dev/shm, nothing to clean up, gone with the
last process that holds it). The reader opens ``/proc/<writer pid>/fd/<n>`` (same user, same
machine), maps it private and closes it (the mapping holds no descriptor; it goes when the last
object that uses it does): no copy until it writes, and then only the pages it writes, so each
rank's tensor stays its own.

The writer holds its memfds until the reader has mapped them: the kernel until the cell ends, a
rank until the kernel's next message. A reader on another machine can't open them: values to or
from such a rank travel in-band, as before (:func:`dump_shared` with ``local=False``).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import pickle
import sys
import weakref
from dataclasses import dataclass, field

__all__ = ["SharedValue", "dump_shared", "reshare", "load_shared", "write_value_file", "read_value_file", "IN_BAND_UNDER",
           "tensor_buffer", "rebuild_tensor"]

IN_BAND_UNDER = 1 << 16  # buffers smaller than this travel in the pickle itself


@dataclass
class SharedValue:
    """A value as it crosses: the pickle without its big buffers, and where each buffer is.

    ``fds`` are the writer's descriptors (numbers in ``/proc/<pid>/fd``), open in the writer only;
    it closes them (:meth:`close`) once the reader has mapped them.
    """

    data: bytes
    pid: int
    fds: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)

    def close(self) -> None:
        """The writer's side: let go of the buffers (a reader's mapping keeps them alive)."""
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []

    @property
    def shared_bytes(self) -> int:
        return sum(self.sizes)


def tensor_buffer(obj):
    """``(rebuild, args)`` that give a CPU tensor's (or parameter's) bytes to pickle 5 as one buffer,
    or None (small, or not a plain strided CPU tensor: its own pickle then). The same for values
    pushed to ranks and for a heal's copy (:mod:`nbdist.worker.namespace_copy`)."""
    torch = sys.modules.get("torch")
    if torch is None or type(obj) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if obj.device.type != "cpu" or obj.layout != torch.strided or obj.is_quantized:
        return None
    if obj.numel() * obj.element_size() < IN_BAND_UNDER:
        return None
    flat = obj.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy()
    return rebuild_tensor, (pickle.PickleBuffer(raw), str(obj.dtype).removeprefix("torch."), tuple(obj.shape),
                            isinstance(obj, torch.nn.Parameter), obj.requires_grad)


def rebuild_tensor(buffer, dtype: str, shape: tuple, parameter: bool = False, requires_grad: bool = False):
    """A tensor over ``buffer`` (mapped copy-on-write: no copy here), as :func:`tensor_buffer` gave it."""
    import torch

    tensor = torch.frombuffer(buffer, dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


@functools.lru_cache(maxsize=None)
def _pickler_class():
    from nbdist.protocol.pickling import SourceKeepingPickler

    class SharingPickler(SourceKeepingPickler):
        def reducer_override(self, obj):
            shared = tensor_buffer(obj)
            return shared if shared is not None else super().reducer_override(obj)

    return SharingPickler


def _dump_out_of_band(value, what: str) -> tuple[bytes, list]:
    """The pickle of ``value`` without its big buffers, and those buffers (pickle protocol 5)."""
    import io

    from nbdist.protocol.pickling import dump_pickle_checked

    buffers: list = []

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        if buf.raw().nbytes < IN_BAND_UNDER:
            return True  # truthy: this one stays in the pickle
        buffers.append(buf.raw().cast("B"))
        return False

    out = io.BytesIO()
    try:
        _pickler_class()(out, protocol=5, buffer_callback=out_of_band).dump(value)
    except Exception:  # the one-line error, from the plain path
        dump_pickle_checked(value, what)
        raise
    return out.getvalue(), buffers


def dump_shared(value, what: str, local: bool = True) -> SharedValue:
    """Pickle ``value``; with ``local``, its big buffers go into memfds that this process holds.

    Raises the one-line TypeError of :func:`nbdist.protocol.pickling.dump_pickle_checked` for a
    value that can't be pickled.
    """
    from nbdist.protocol.pickling import dump_pickle_checked

    if not local:
        return SharedValue(dump_pickle_checked(value, what), os.getpid())
    data, buffers = _dump_out_of_band(value, what)
    shared = SharedValue(data, os.getpid())
    try:
        for raw in buffers:
            fd = os.memfd_create("nbdist-value", os.MFD_CLOEXEC)
            shared.fds.append(fd)
            shared.sizes.append(raw.nbytes)
            _write_all(fd, raw)  # the one copy; write() fills a memfd in half the time a mapping does
    except BaseException:
        shared.close()
        raise
    return shared


def reshare(shared: SharedValue) -> SharedValue:
    """Another process's shared value, handed on by this one without a copy: this process opens the
    writer's memfds (descriptors of its own, to the same memory), so a further reader can map them
    after the writer let go. The caller closes it (:meth:`SharedValue.close`) as its writer would.
    OSError where the writer is gone, or no longer holds the value: the caller copies it instead."""
    fds: list[int] = []
    try:
        for fd, size in zip(shared.fds, shared.sizes):
            path = f"/proc/{shared.pid}/fd/{fd}"
            fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            # The writer may have let go already and given the number to another file: refuse that.
            if not os.readlink(path).startswith("/memfd:nbdist-value") or os.fstat(fds[-1]).st_size != size:
                raise FileNotFoundError(f"{path} is no longer the value's memory")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return SharedValue(shared.data, os.getpid(), fds, list(shared.sizes))


def load_shared(shared: SharedValue):
    """The value, its big buffers mapped copy-on-write from the writer's memfds (no copy here)."""
    buffers = [_map_private(f"/proc/{shared.pid}/fd/{fd}", size) for fd, size in zip(shared.fds, shared.sizes)]
    return pickle.loads(shared.data, buffers=buffers)


@functools.lru_cache(maxsize=None)
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


def write_value_file(path: str, value, what: str) -> None:
    """Write ``value`` to ``path`` so that readers map its big buffers instead of unpickling them.

    For what outlives its writer (a one-shot rank's ``--pull`` variables and return value, a
    cell's pushed values): the pickle, then each big buffer at a page boundary, then where each
    one is. Written once (the one copy, into the page cache), atomically (nobody maps half a file),
    mode 0600; readers on other machines of a shared filesystem read it the same way.
    """
    data, buffers = _dump_out_of_band(value, what)
    page = mmap.ALLOCATIONGRANULARITY
    places, offset = [], len(data)
    for raw in buffers:
        offset = -(-offset // page) * page
        places.append((offset, raw.nbytes))
        offset += raw.nbytes
    trailer = pickle.dumps((len(data), places))
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, data)
        for (offset, _), raw in zip(places, buffers):
            os.lseek(fd, offset, os.SEEK_SET)
            _write_all(fd, raw)
        os.lseek(fd, 0, os.SEEK_END)
        _write_all(fd, trailer + len(trailer).to_bytes(8, "little"))
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)  # a new inode: a reader's mapping of an older file never changes under it


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def read_value_file(path: str):
    """The value :func:`write_value_file` left at ``path``, its big buffers mapped copy-on-write.

    The mappings don't need the file: the caller may delete it as soon as this returns.
    """
    with open(path, "rb") as fh:
        fh.seek(-8, os.SEEK_END)
        trailer_size = int.from_bytes(fh.read(8), "little")
        fh.seek(-8 - trailer_size, os.SEEK_END)
        data_size, places = pickle.loads(fh.read(trailer_size))
        fh.seek(0)
        data = fh.read(data_size)
    buffers = [_map_private(path, size, offset) for offset, size in places]
    return pickle.loads(data, buffers=buffers)


def _map_private(path: str, size: int, offset: int = 0):
    """A private (copy-on-write) mapping of ``path``, as a writable buffer unmapped when nothing holds it.

    Not ``mmap.mmap``: it keeps a duplicate of the file descriptor for the mapping's whole life, and
    a rank holding many pushed tensors would run out of descriptors.
    """
    libc = _libc()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, offset)
    finally:
        os.close(fd)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, f"can't map {path}: {os.strerror(err)}")
    buffer = (ctypes.c_ubyte * size).from_address(addr)
    weakref.finalize(buffer, libc.munmap, addr, size)
    return buffer
