"""A DCP reader that checks each shard's CRC32 (recorded at save, crc32.json) while the load reads it: the bytes are
read from disk once. Before, the resume check read every byte of the checkpoint for the CRCs and the ranks' load read
them all again (a 60 GB checkpoint: 120 GB of start-up reads).

Each file is checked by one rank (SummingReader), in file order: a read past the bytes summed so far first sums the
gap (items that rank does not load), and the bytes after its last read are summed when the file is closed. The
stream says it is not seekable, so DCP reads each item whole into memory before torch.load (which would read a
seekable one's zip end first, then its data: every byte read twice; the cost: one item's bytes in memory beside its
tensor while it loads). A mismatch raises, which DCP reports on every rank."""

from __future__ import annotations

import dataclasses
import io
import os
import zlib
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadPlan

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
        self.root, self.crcs = root, crcs  # crcs: {file name under root: CRC32}, the files this rank checks

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
            raise ChecksumMismatch(f"dcp/{name}: CRC32 {crc:08x}, saved as {self.crcs[name]:08x} (its bytes changed "
                                   "since the save)") from error


class SummingReader(FileSystemReader):
    """Reads <checkpoint>/dcp, checking the shards named in `crcs` ({"dcp/<file>": CRC32}). Each file is checked by
    one rank, the one that loads the most of it (the coordinator's plan says which: a replicated entry, saved by one
    rank, is read by every rank, and its file must not be read whole by each)."""

    def __init__(self, dcp_dir: Path, crcs: dict[str, int]):
        super().__init__(str(dcp_dir))
        self.crcs = {name.removeprefix("dcp/"): crc for name, crc in crcs.items()}

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        most: dict[str, tuple[int, int]] = {}  # file -> (bytes, rank) of the rank that loads the most of it
        for rank, plan in enumerate(plans):
            loads = Counter()
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                loads[info.relative_path] += info.length
            for name, n in loads.items():
                if name in self.crcs and n > most.get(name, (-1, 0))[0]:
                    most[name] = (n, rank)
        return [dataclasses.replace(plan, storage_data=sorted(name for name, (_, r) in most.items() if r == rank))
                for rank, plan in enumerate(super().prepare_global_plan(plans))]

    def read_data(self, plan: LoadPlan, planner):
        self.fs = _SummingFileSystem(Path(self.path), {name: self.crcs[name] for name in plan.storage_data or ()})
        return super().read_data(plan, planner)
