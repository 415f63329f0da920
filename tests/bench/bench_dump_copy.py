"""The client's ways of getting a dump's states into a shard, CPU seconds per GiB (one process).

A dump's states must reach the shard with their CRC32 (the zip records need it before the records
after them). Each way, on a `--size` MiB file of random bytes in `SRC_DIR` (page cache) copied to
`OUT_DIR`, no fsync, `--runs` times, medians printed:
  pread_all_nan   pread into a sample-sized buffer, NaN check (publisher.all_finite), CRC, write (#38)
  pread_all       the same without the NaN check (the hook's `finite` header makes it unneeded)
  crc_sendfile    a CRC pass through a 1 MiB buffer, then sendfile (the "way back" first planned)
  mapped          mmap, CRC of the mapping, sendfile (1b13eb4: a dump that shrinks is a SIGBUS)
  buffer_pass     pread 1 MiB, CRC it, write it, repeat (FileBytes.copy_to: what the writer does)
  sendfile_only   sendfile with no CRC at all (would need a CRC from the hook)
  copy_check      FileBytes.copy_to with its NaN/Inf check: buffer_pass plus a masked max over
                  the exponent bits of each 1 MiB chunk
  copy_direct     the same into a DirectSink (#49, the writer's path): read into the aligned
                  staging buffer, checked there, written with O_DIRECT (no page cache for the shard)
  check_send      the check and CRC in a pass through a 1 MiB buffer, then the in-kernel copy:
                  copy_file_range, or sendfile where it says EXDEV (a dump on tmpfs, the shard
                  on disk: Linux refuses copy_file_range across file systems)
  hook_zlib_crc   what the hook would pay to CRC its host bytes with zlib (the server's CPU)

    .venv/bin/python tests/bench/bench_dump_copy.py [--size 212] [--runs 5] [SRC_DIR [OUT_DIR]]
"""

from __future__ import annotations

import argparse
import errno
import mmap
import os
import resource
import statistics
import sys
import zlib
from pathlib import Path

sys.path[:0] = [
    str(Path(__file__).resolve().parents[2]),
    str(Path(__file__).resolve().parents[2] / "module_utils"),
]
import torch  # noqa: E402

from extraction.publish.publisher import all_finite  # noqa: E402
from extraction.shards.direct import DirectSink  # noqa: E402
from extraction.shards.filebytes import FileBytes, OpenFile, first_nonfinite  # noqa: E402
from hsx.crc import active_crc32  # noqa: E402

CRC32, _ = active_crc32()
CHUNK = 1 << 20


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=212, help="MiB (212: a 3,700-token K2.5 sample's states)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("src_dir", nargs="?", default="/dev/shm")
    ap.add_argument("out_dir", nargs="?", default="/var/tmp")
    a = ap.parse_args()
    size = a.size << 20
    src, out = (
        os.path.join(a.src_dir, f"hsx-bench-dump-{os.getpid()}"),
        os.path.join(a.out_dir, f"hsx-bench-shard-{os.getpid()}"),
    )
    with open(src, "wb") as f:
        f.write(torch.randn(size // 2).to(torch.bfloat16).view(torch.uint8).numpy().tobytes())

    def new_out() -> int:
        if os.path.exists(out):
            os.unlink(out)
        return os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)

    def write_all(fd: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])

    def sendfile_all(o: int, fd: int) -> None:
        done = 0
        while done < size:
            done += os.sendfile(o, fd, done, size - done)

    def pread_all(fd: int, nan_check: bool) -> None:
        buf = torch.empty(size, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        done = 0
        while done < size:
            done += os.preadv(fd, [view[done:]], done)
        if nan_check:
            all_finite(buf.view(torch.bfloat16))
        CRC32(view)
        o = new_out()
        write_all(o, view)
        os.close(o)

    def crc_sendfile(fd: int) -> None:
        view, crc, done = memoryview(bytearray(CHUNK)), 0, 0
        while done < size:
            got = os.preadv(fd, [view[: min(CHUNK, size - done)]], done)
            crc, done = CRC32(view[:got], crc), done + got
        o = new_out()
        sendfile_all(o, fd)
        os.close(o)

    def mapped(fd: int) -> None:
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        CRC32(mm)
        o = new_out()
        sendfile_all(o, fd)
        os.close(o)
        mm.close()

    def buffer_pass(fd: int) -> None:
        view, crc, done, o = memoryview(bytearray(CHUNK)), 0, 0, new_out()
        while done < size:
            got = os.preadv(fd, [view[: min(CHUNK, size - done)]], done)
            crc = CRC32(view[:got], crc)
            write_all(o, view[:got])
            done += got
        os.close(o)

    def copy_check(fd: int, direct: bool = False) -> None:
        held = OpenFile(os.dup(fd), src, size)
        o = new_out()
        sink = DirectSink(o) if direct else None
        FileBytes(torch.bfloat16, (size // 2,), ((held, 0, size),), check=True).copy_to(sink or o, CRC32)
        if sink is not None:
            sink.finish()
        os.close(o)
        held.close()

    def check_send(fd: int) -> None:
        view, crc, done = memoryview(bytearray(CHUNK)), 0, 0
        while done < size:
            got = os.preadv(fd, [view[: min(CHUNK, size - done)]], done)
            crc, done = CRC32(view[:got], crc), done + got
            assert first_nonfinite(view[:got], torch.bfloat16) is None
        o, done = new_out(), 0
        try:
            while done < size:
                done += os.copy_file_range(fd, o, size - done, done)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            while done < size:
                done += os.sendfile(o, fd, done, size - done)
        os.close(o)

    def sendfile_only(fd: int) -> None:
        o = new_out()
        sendfile_all(o, fd)
        os.close(o)

    ways = {
        "pread_all_nan": lambda fd: pread_all(fd, True),
        "pread_all": lambda fd: pread_all(fd, False),
        "crc_sendfile": crc_sendfile,
        "mapped": mapped,
        "buffer_pass": buffer_pass,
        "sendfile_only": sendfile_only,
        "copy_check": copy_check,
        "copy_direct": lambda fd: copy_check(fd, direct=True),
        "check_send": check_send,
    }
    got: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for _ in range(a.runs):
            for name, way in ways.items():
                fd = os.open(src, os.O_RDONLY)
                t0 = cpu()
                way(fd)
                got[name].append((cpu() - t0) / (size / 2**30))
                os.close(fd)
        with open(src, "rb") as f:
            data = f.read()
        t0 = cpu()
        zlib.crc32(data)
        hook = (cpu() - t0) / (size / 2**30)
    finally:
        for path in (src, out):
            if os.path.exists(path):
                os.unlink(path)
    print(f"{a.size} MiB from {a.src_dir} to {a.out_dir}, {a.runs} runs, CPU s/GiB median [min - max]:")
    for name, values in got.items():
        print(f"  {name:14s} {statistics.median(values):.2f} [{min(values):.2f} - {max(values):.2f}]")
    print(f"  {'hook_zlib_crc':14s} {hook:.2f}")


if __name__ == "__main__":
    main()
