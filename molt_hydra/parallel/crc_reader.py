"""A DCP reader that checks each file's CRC32 (recorded at save, crc32.json) while the load reads it: the bytes are
read from disk once. Before, the resume check read every byte of the checkpoint for the CRCs and the ranks' load read
them all again (a 60 GB checkpoint: 120 GB of start-up reads).

The CRC is taken in file order: a read past the bytes summed so far first sums the gap (an item this rank does not
load), and the bytes after the last read are summed when the file is closed. The stream says it is not seekable, so
DCP reads each item whole into memory before torch.load (which would read a seekable one's zip end first, then its
data: every byte read twice). Each file is checked by the ranks that read it; a mismatch raises, which DCP reports on
every rank."""

from __future__ import annotations

import io
import os
import zlib
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem

CHUNK = 1 << 24


class ChecksumMismatch(ValueError):
    """A file whose bytes are not the ones saved."""


class _Summed(io.RawIOBase):
    """`base` (a file opened "rb"), whose bytes 0..`done` are summed into `crc` as they are first read."""

    def __init__(self, base):
        super().__init__()
        self.base, self.crc, self.done = base, 0, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False  # DCP then reads each item whole, at once, into memory: its bytes are read once, in order

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.base.seek(offset, whence)

    def tell(self) -> int:
        return self.base.tell()

    def readinto(self, b) -> int:
        at = self.base.tell()
        if at > self.done:  # a read past the summed bytes: the gap first, so that the sum stays in file order
            self._sum_to(at)
        n = self.base.readinto(b)
        if n and at + n > self.done:
            self.crc = zlib.crc32(memoryview(b)[self.done - at:n], self.crc)
            self.done = at + n
        return n

    def _sum_to(self, end: int | None) -> None:
        """Sums the bytes from `done` up to `end` (None: the end of the file); the position is kept."""
        at = self.base.tell()
        self.base.seek(self.done)
        while (end is None or self.done < end) and (chunk := self.base.read(
                CHUNK if end is None else min(CHUNK, end - self.done))):
            self.crc = zlib.crc32(chunk, self.crc)
            self.done += len(chunk)
        self.base.seek(at)

    def finish(self) -> int:
        self._sum_to(None)
        return self.crc


class _SummingFileSystem(FileSystem):
    def __init__(self, root: Path, crcs: dict[str, int]):
        super().__init__()
        self.root, self.crcs = root, crcs  # crcs: {name relative to the checkpoint directory: CRC32}

    @contextmanager
    def create_stream(self, path, mode: str):
        name = Path(path).relative_to(self.root).as_posix() if mode == "rb" else None
        if name not in self.crcs:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, "rb") as base:
            summed = _Summed(base)
            try:
                yield summed
            except Exception as e:  # changed bytes that torch.load could not read: the mismatch is the cause
                self._check(name, summed, e)
                raise
            self._check(name, summed)

    def _check(self, name: str, summed: _Summed, error: Exception | None = None) -> None:
        if (crc := summed.finish()) != self.crcs[name]:
            raise ChecksumMismatch(f"{name}: CRC32 {crc:08x}, saved as {self.crcs[name]:08x} (its bytes changed "
                                   "since the save)") from error


def summing_reader(dcp_dir: Path, crcs: dict[str, int]) -> FileSystemReader:
    """A reader of `dcp_dir` (<checkpoint>/dcp) that checks the files named in `crcs` ({"dcp/<file>": CRC32})."""
    reader = FileSystemReader(str(dcp_dir))
    reader.fs = _SummingFileSystem(dcp_dir.parent, crcs)
    return reader
