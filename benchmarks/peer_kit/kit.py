"""Pack a folder into call-sized parts with checksums, and unpack them byte-identical (the peer kit's carrier).

A device call carries at most 64 MiB, so the kit (about 160 MiB of wheels) travels as parts, one per call,
stashed under /var/tmp on the GPU machine until all have arrived::

    python3 kit.py pack TREE OUT [--part-mib 42]   # OUT/peers.tar.part-00 ..., OUT/SHA256SUMS
    python3 kit.py unpack PARTS DEST               # checks every part and the whole, then extracts into DEST
    python3 kit.py missing PARTS                   # the parts not there yet (exit 1 while any is missing)

The tar is written in a fixed order with fixed metadata, so the same tree packs to the same bytes. Standard
library only: it runs on the GPU image before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import tarfile
from pathlib import Path

NAME = "peers.tar"
SUMS = "SHA256SUMS"


def _tar_bytes(tree: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p for p in tree.rglob("*") if p.is_file()):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(tree)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            info.mode = 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)
    return buf.getvalue()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack(tree: Path, out: Path, part_bytes: int) -> list[Path]:
    """Write ``tree`` as parts of at most ``part_bytes`` into ``out`` with SHA256SUMS; returns the parts."""
    data = _tar_bytes(tree)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{NAME}.part-*"):
        old.unlink()
    parts, lines = [], []
    for i, start in enumerate(range(0, len(data), part_bytes)):
        part = out / f"{NAME}.part-{i:02d}"
        chunk = data[start:start + part_bytes]
        part.write_bytes(chunk)
        parts.append(part)
        lines.append(f"{_sha(chunk)}  {part.name}")
    lines.append(f"{_sha(data)}  {NAME}")
    (out / SUMS).write_text("\n".join(lines) + "\n")
    return parts


def _sums(parts_dir: Path) -> dict[str, str]:
    sums = {}
    for line in (parts_dir / SUMS).read_text().splitlines():
        digest, _, name = line.partition("  ")
        sums[name] = digest
    return sums


def missing(parts_dir: Path) -> list[str]:
    """The parts SHA256SUMS names that are not in ``parts_dir`` yet."""
    if not (parts_dir / SUMS).is_file():
        return [SUMS]
    return [name for name in _sums(parts_dir) if name != NAME and not (parts_dir / name).is_file()]


def unpack(parts_dir: Path, dest: Path) -> None:
    """Check every part and the whole against SHA256SUMS, then extract into ``dest``; ValueError on any mismatch."""
    gone = missing(parts_dir)
    if gone:
        raise ValueError(f"parts missing in {parts_dir}: {', '.join(gone)}")
    sums = _sums(parts_dir)
    chunks = []
    for name in sorted(n for n in sums if n != NAME):
        chunk = (parts_dir / name).read_bytes()
        if _sha(chunk) != sums[name]:
            raise ValueError(f"{name}: checksum mismatch (a damaged or foreign part)")
        chunks.append(chunk)
    data = b"".join(chunks)
    if _sha(data) != sums[NAME]:
        raise ValueError(f"{NAME}: the reassembled kit does not match its checksum")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(dest, filter="data")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("tree", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--part-mib", type=int, default=42)
    u = sub.add_parser("unpack")
    u.add_argument("parts", type=Path)
    u.add_argument("dest", type=Path)
    m = sub.add_parser("missing")
    m.add_argument("parts", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "pack":
            for part in pack(args.tree, args.out, args.part_mib << 20):
                print(f"{part}  {part.stat().st_size / 2**20:.1f} MiB")
        elif args.cmd == "unpack":
            unpack(args.parts, args.dest)
            print(f"unpacked into {args.dest}")
        else:
            gone = missing(args.parts)
            print("missing: " + (", ".join(gone) if gone else "none"))
            return 1 if gone else 0
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
