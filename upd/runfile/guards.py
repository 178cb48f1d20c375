"""The run file's bytes as HDF5 reads them, checked where the HDF5 C library (2.0.0) would hang or over-allocate.

HDF5 parses what the file says: a corrupted file can make it loop forever holding the GIL (no Python signal gets
in) or allocate gigabytes a 4-byte length claims. ``GuardedFile`` is the file object h5py's ``fileobj`` driver reads
through, so every byte HDF5 reads passes here first; it also parses the few structures the reader must check before
HDF5 trusts them (docs/reliability.md, "Where HDF5 itself needs help"). The superblock parsing is shared with the
writer, which reads HDF5's end of allocated space from it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import h5py

from . import livelock, schema

SUPERBLOCK_BYTES = 64  # every superblock field read here lies in the first 64 bytes (versions 0-3)
SUPERBLOCK_SEARCH_BYTES = 1 << 20  # HDF5 looks for the signature at 0, 512, 1024, 2048, ... (user block sizes)
# Reads into a caller's buffer without an intermediate bytes object (POSIX; where absent, os.pread and a copy).
_PREADV = getattr(os, "preadv", None)


@dataclass(frozen=True)
class Superblock:
    """The fields of HDF5's superblock torch-upd reads (HDF5 file format specification, "Superblock")."""

    version: int
    offset_size: int  # "size of offsets": bytes of every file address
    length_size: int  # "size of lengths": bytes of every stored length
    end_of_allocation: int | None  # base address + end-of-file address; versions 0 and 1 with 8-byte offsets only


def parse_superblock(head: bytes) -> Superblock | None:
    """The superblock that starts `head` (the bytes from its signature on); None when there is none.

    Versions 0 and 1 (HDF5's default file format, the one this writer creates) keep the sizes at bytes 13 and 14 and
    the addresses after 24 (version 0) or 28 bytes (version 1 adds the indexed storage K and 2 reserved bytes): base
    address, free-space address, end-of-file address. Versions 2 and 3 keep the sizes at bytes 9 and 10.
    """
    if len(head) < 16 or head[:8] != schema.HDF5_SIGNATURE:
        return None
    version = head[8]
    if version not in (0, 1):
        return Superblock(version, head[9], head[10], None)
    offsets, lengths = head[13], head[14]
    end = None
    base = 24 if version == 0 else 28
    if offsets == 8 and len(head) >= base + 24:
        eoa = base + 2 * offsets
        end = int.from_bytes(head[base:base + 8], "little") + int.from_bytes(head[eoa:eoa + 8], "little")
    return Superblock(version, offsets, lengths, end)


def find_superblock(fd: int, size: int) -> Superblock | None:
    """The superblock of the HDF5 file open at fd, searched where HDF5 searches (0, 512, 1024, ...)."""
    at = 0
    while at + 16 <= min(size, SUPERBLOCK_SEARCH_BYTES):
        found = parse_superblock(os.pread(fd, SUPERBLOCK_BYTES, at))
        if found is not None:
            return found
        at = 512 if at == 0 else at * 2
    return None


def disk_bytes(st: os.stat_result) -> int:
    """Bytes a file really holds: its apparent size less its holes (a sparse file reads zeros it does not store).
    Filesystems that report no blocks (st_blocks 0 for a non-empty file, or none at all) count the apparent size."""
    blocks = getattr(st, "st_blocks", 0) or 0
    return min(st.st_size, blocks * 512) if blocks else st.st_size


class GuardedFile:
    """The run file as HDF5 reads it (h5py's ``fileobj`` driver), with the checks HDF5 (2.0.0) lacks.

    HDF5 loops forever, holding the GIL, when a global heap collection (where variable-length strings such as every
    JSON attribute live) contains a zero-size object: 16 zeroed bytes in the file hang any reader. Every read HDF5
    makes passes here; a collection is walked in Python the way HDF5 will walk it, once, and refused (an OSError
    HDF5 reports as a read error) when the walk would not advance. The methods below read the stored references
    of variable-length strings, whose claimed lengths HDF5 allocates before reading them.
    """

    MAX_COLLECTION = schema.MAX_META_BYTES + (1 << 20)  # the largest string a run holds, in a collection of its own

    _GCOL = b"GCOL"

    def __init__(self, path: str, fd: int | None = None, snapshot: bool = False):
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0)) if fd is None else fd
        self._pos = 0
        opened = os.fstat(self._fd)
        self._size = opened.st_size
        self.disk_bytes = disk_bytes(opened)
        self._granted: dict[str, int] = {}  # dataset name -> largest block the reader was allowed to read from it
        self._granted_total = 0
        # Read in place (not a private copy): HDF5 reads it lazily, so a writer that starts later (resume=True)
        # could change metadata under the reader's cache. Reads after that are refused, not trusted.
        self._identity = None if snapshot else (opened.st_size, opened.st_mtime_ns)
        self._changed = False
        self._checked: set[int] = set()
        self._attr_cache: dict[int, dict | None] = {}
        # {(file number, object address): the name it was first reached by}: one object, one name, shared by every
        # validate.Validator of this file (Validator.child)
        self.object_names: dict[tuple, tuple] = {}
        self._offset_size, self._length_size = self._superblock_sizes()

    def _superblock_sizes(self) -> tuple[int, int]:
        """HDF5's 'size of offsets' and 'size of lengths' from the superblock; 8 and 8 when it cannot be found or
        states other sizes (HDF5 then refuses the file anyway)."""
        found = find_superblock(self._fd, self._size)
        if found is None:
            return 8, 8
        return (found.offset_size if found.offset_size in (2, 4, 8) else 8,
                found.length_size if found.length_size in (2, 4, 8) else 8)

    @property
    def size(self) -> int:
        """Bytes in the file as it was opened (the copy's, for a run being written)."""
        return self._size

    def grant(self, name: str, nbytes: int) -> int:
        """Count a block of `nbytes` read from dataset `name` (each dataset at its largest); the total so far."""
        before = self._granted.get(name, 0)
        if nbytes > before:
            self._granted[name] = nbytes
            self._granted_total += nbytes - before
        return self._granted_total

    def changed_under_us(self) -> bool:
        """True once the file read in place has been changed, or is open for writing (sticky)."""
        if self._identity is None or self._changed or self._fd < 0:
            return self._changed
        now = os.fstat(self._fd)
        self._changed = (now.st_size, now.st_mtime_ns) != self._identity or livelock.writer_present(self._fd)
        return self._changed

    # -- the file-like interface h5py's fileobj driver uses ------------------------------------------------------
    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else self._size + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        size = max(0, min(len(buffer), self._size - self._pos))
        if _PREADV is not None:  # straight into HDF5's buffer: a 200 MB read is not held twice (bytes, then copied)
            view = memoryview(buffer).cast("B")
            n = _PREADV(self._fd, [view[:size]], self._pos) if size else 0
            data = bytes(view[:min(n, 4)])
        else:
            data = os.pread(self._fd, size, self._pos)
            n = len(data)
            buffer[:n] = data
        if data[:4] == self._GCOL and self._pos not in self._checked:
            self._check_collection(self._pos)
        self._pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        size = self._size - self._pos if size is None or size < 0 else size
        buffer = bytearray(size)
        return bytes(buffer[: self.readinto(memoryview(buffer))])

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    __del__ = close  # only ever collected after HDF5 let go of it: h5py's driver holds a reference until then

    # -- variable-length data, before HDF5 allocates for it --------------------------------------------------
    # HDF5 allocates (and zeroes) the length a variable-length element's stored reference claims before it looks
    # at the heap object: one corrupted 4-byte length is a 4 GiB allocation. These read the stored references
    # themselves (an attribute's in its object header, a dataset element's in its chunk) so the reader can refuse
    # an absurd length first.

    def vlen_ref_size(self) -> int:
        return 4 + self._offset_size + 4  # sequence length, heap collection address, object index

    def vlen_lengths(self, raw: bytes) -> list[int]:
        step = self.vlen_ref_size()
        return [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw) - step + 1, step)]

    def dataset_vlen_lengths(self, ds: h5py.Dataset, rows: range) -> list[int] | None:
        """Stored lengths of the variable-length elements `rows` of a 1-D dataset, read from the file itself;
        None when they are not stored plainly (compressed chunks, compact layout): HDF5 then reads them unchecked.
        Fixed-length strings (the same JSON, written by another tool) have no references: each is its itemsize."""
        info = h5py.check_string_dtype(ds.dtype)
        if info is not None and info.length is not None:
            return [ds.dtype.itemsize] * len(rows)
        step = self.vlen_ref_size()
        dcpl = ds.id.get_create_plist()
        layout = dcpl.get_layout()
        if layout == h5py.h5d.CONTIGUOUS:
            base = ds.id.get_offset()
            return [0 if base is None else int.from_bytes(self._pread(4, base + r * step), "little") for r in rows]
        if layout != h5py.h5d.CHUNKED or dcpl.get_nfilters():
            return None
        chunk = dcpl.get_chunk()[0]
        out = []
        for r in rows:
            first = r // chunk * chunk
            info = ds.id.get_chunk_info_by_coord((first,))
            out.append(0 if info.byte_offset is None else  # never written: fill values, empty strings
                       int.from_bytes(self._pread(4, info.byte_offset + (r - first) * step), "little"))
        return out

    def attributes(self, header_addr: int) -> dict[str, tuple[int, list[int]]] | None:
        """{attribute name: (number of elements, stored lengths of its variable-length elements)} for the attributes
        kept in the object header at header_addr (HDF5's compact attribute storage). None when the header is not
        laid out that way (dense attribute storage, an unknown version): HDF5 is then left to read them unchecked."""
        if header_addr in self._attr_cache:
            return self._attr_cache[header_addr]
        try:
            found = self._parse_object_header(header_addr)
        except (IndexError, ValueError, OSError):
            found = None
        self._attr_cache[header_addr] = found
        return found

    def _pread(self, size: int, at: int) -> bytes:
        if at < 0 or size < 0 or at + size > self._size or size > 1 << 24:
            raise ValueError("a stored block lies outside the file")
        return os.pread(self._fd, size, at)

    def _parse_object_header(self, addr: int) -> dict[str, tuple[int, list[int]]] | None:
        o, n = self._offset_size, self._length_size
        head = self._pread(16, addr)
        blocks = []  # (start, end, message header size, creation-order flag known per message)
        if head[:4] == b"OHDR":
            if head[4] != 2:
                return None
            flags = head[5]
            at = addr + 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
            width = 1 << (flags & 0x03)
            chunk = int.from_bytes(self._pread(width, at), "little")
            at += width
            blocks.append((at, at + chunk, 2, flags & 0x04))
        elif head[0] == 1:
            size = int.from_bytes(head[8:12], "little")
            blocks.append((addr + 16, addr + 16 + size, 1, 0))
        else:
            return None
        out: dict[str, tuple[int, list[int]]] = {}
        seen = 0
        while blocks:
            start, end, version, order = blocks.pop()
            seen += 1
            if seen > 64:
                raise ValueError("too many object header continuation blocks")
            data = self._pread(end - start, start)
            p = 0
            while True:
                if version == 1:
                    if p + 8 > len(data):
                        break
                    mtype = int.from_bytes(data[p:p + 2], "little")
                    msize = int.from_bytes(data[p + 2:p + 4], "little")
                    body = p + 8
                else:
                    hsize = 6 if order else 4
                    if p + hsize > len(data) - 4:  # the last 4 bytes are the checksum
                        break
                    mtype = data[p]
                    msize = int.from_bytes(data[p + 1:p + 3], "little")
                    body = p + hsize
                message = data[body:body + msize]
                if len(message) < msize:
                    raise ValueError("object header message runs past its block")
                if mtype == 0x0010:  # continuation: another block of messages
                    c_at = int.from_bytes(message[:o], "little")
                    c_len = int.from_bytes(message[o:o + n], "little")
                    if version == 2:
                        if self._pread(4, c_at) != b"OCHK":
                            raise ValueError("bad continuation block")
                        blocks.append((c_at + 4, c_at + c_len, 2, order))
                    else:
                        blocks.append((c_at, c_at + c_len, 1, 0))
                elif mtype == 0x0015:  # attribute info: where dense attribute storage (a fractal heap) is, if used
                    heap = message[2 + (2 if message[1] & 0x01 else 0):][:o]
                    if heap != b"\xff" * o:
                        return None  # the attributes live in the fractal heap, not in this header
                elif mtype == 0x000C:
                    name, count, lengths = self._attribute_message(message)
                    if name is not None:
                        out[name] = (count, lengths)
                p = body + msize
        return out

    def _attribute_message(self, m: bytes) -> tuple[str | None, int, list[int]]:
        """(name, number of elements, their stored variable-length lengths) of an attribute message (no lengths for
        fixed-size data); name None when the message describes its type elsewhere (shared) or is unknown."""
        version, flags = m[0], m[1]
        name_size = int.from_bytes(m[2:4], "little")
        dt_size = int.from_bytes(m[4:6], "little")
        ds_size = int.from_bytes(m[6:8], "little")
        if version == 1:
            pad = lambda x: (x + 7) & ~7  # noqa: E731
            p = 8
            name = m[p:p + name_size]
            p += pad(name_size)
            dt = m[p:p + dt_size]
            p += pad(dt_size)
            ds = m[p:p + ds_size]
            p += pad(ds_size)
        elif version in (2, 3):
            if flags & 0x03:  # shared datatype or dataspace: not described here
                return None, 0, []
            p = 8 if version == 2 else 9
            name = m[p:p + name_size]
            p += name_size
            dt = m[p:p + dt_size]
            p += dt_size
            ds = m[p:p + ds_size]
            p += ds_size
        else:
            return None, 0, []
        name = name.split(b"\0", 1)[0].decode("utf-8", "replace")
        count = self._dataspace_elements(ds)
        if not dt or dt[0] & 0x0F != 9:  # not variable-length
            return name, count, []
        return name, count, self.vlen_lengths(m[p:p + min(count, 1 << 20) * self.vlen_ref_size()])

    def _dataspace_elements(self, ds: bytes) -> int:
        version, rank = ds[0], ds[1]
        if version == 2 and ds[3] == 2:  # null dataspace
            return 0
        start = 8 if version == 1 else 4
        count = 1
        for i in range(rank):
            count *= int.from_bytes(ds[start + i * self._length_size:start + (i + 1) * self._length_size], "little")
        return count

    # -- the check ---------------------------------------------------------------------------------------------
    def _check_collection(self, at: int) -> None:
        """Walk the global heap collection at byte `at` as HDF5's H5HG deserializer does; raise when it would loop."""
        n = self._length_size
        header = os.pread(self._fd, 8 + n, at)
        if len(header) < 8 + n:
            return  # HDF5 reports a short collection itself
        size = int.from_bytes(header[8:8 + n], "little")
        if size > self.MAX_COLLECTION:
            raise OSError(f"global heap collection at byte {at} claims {size} bytes (a run's strings need at most "
                          f"{self.MAX_COLLECTION})")
        data = os.pread(self._fd, min(size, self._size - at), at)
        if len(data) < size:
            return  # beyond the end of the file: HDF5 reports it
        obj_header = 2 + 2 + 4 + n
        p = (8 + n + 7) & ~7  # H5HG_SIZEOF_HDR, aligned
        mask = (1 << 64) - 1
        while p < size:
            if p + obj_header > size:
                break  # HDF5 takes the rest as free space
            idx = int.from_bytes(data[p:p + 2], "little")
            length = int.from_bytes(data[p + 8:p + 8 + n], "little")
            need = (obj_header + ((length + 7) & ~7 & mask)) & mask if idx else length
            if need == 0 or need >= 1 << 63:  # p would not move forward (or would wrap around)
                raise OSError(f"corrupted global heap collection at byte {at}: object at byte {at + p} has "
                              f"size {length}")
            p += need
        self._checked.add(at)
