"""Cut the CUDA fat binaries of a shared library to the cubins of one GPU architecture (sm_90: H100/H200),
in place, so that a wheel's multi-architecture extensions travel to the device machine at a fraction of
their size (scripts/vllm_bundle.sh, scripts/te_bundle.sh).

The .nv_fatbin section holds one container per .cu file (magic 0xBA55ED50, then its entries: PTX or ELF
cubins, each with its architecture). Each container keeps its sm_90/sm_90a cubins, moved to its start, and
its size field shrinks to them; the bytes freed are zeroed, so the file keeps its size and layout (the
host code's pointers to each container stay valid) and compresses to the kept cubins.

    python3 scripts/fatbin.py LIB.so [LIB.so ...]
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

FATBIN_MAGIC, KIND_PTX, KIND_ELF, ARCH = 0xBA55ED50, 1, 2, 90


def nv_fatbin_section(data):
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    stroff = hdrs[shstrndx][4]
    for h in hdrs:
        if data[stroff + h[0]:data.index(b"\0", stroff + h[0])] == b".nv_fatbin":
            return h[4], h[5]
    sys.exit("fatbin: no .nv_fatbin section")


def containers(data, off, size):
    p, end = off, off + size
    while p + 16 <= end:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            p += 8
            continue
        q, cend, ents = p + hsz, p + hsz + fsz, []
        while q < cend:
            kind, _u, ehs, psz = struct.unpack_from("<HHIQ", data, q)
            arch, = struct.unpack_from("<I", data, q + 28)
            ents.append((q, kind, ehs + psz, arch))
            q += ehs + psz
        if q != cend:
            sys.exit(f"fatbin: malformed fatbin container at {p:#x}")
        yield p, hsz, fsz, ents
        p = cend


def ptx_entries(data, e):
    """The kernel names in a PTX entry (zstd-compressed, as nvcc 13 writes them, or plain)."""
    _kind, _u, ehs, _psz, comp = struct.unpack_from("<HHIQI", data, e[0])
    body = bytes(data[e[0] + ehs:e[0] + ehs + comp])
    if body[:4] == b"\x28\xb5\x2f\xfd":
        body = subprocess.run(["zstd", "-dcq"], input=body, capture_output=True, check=True).stdout
    return re.findall(rb"\.entry\s+(\S+?)\(", body)


def prune(path: Path, keep_ptx=None) -> list[str]:
    """Each container (one per .cu file) keeps its sm_90/sm_90a cubins. One without any (kernels built
    only for other GPUs or only as PTX: Marlin, sm_89/100/120 CUTLASS, NVFP4, ...) gets the smallest
    cubin of another architecture instead: well-formed, and still without an image for sm_90, exactly
    as before on an H100/H200 (its PTX is dropped, so those kernels can't be JIT-compiled). With keep_ptx
    (a compiled pattern) such a container keeps its newest PTX for an architecture <= sm_90 instead if one
    of its kernels matches: the driver JIT-compiles it for sm_90. Freed bytes are zeroed; the file keeps
    its size and layout. Returns the containers that kept PTX (`name@offset`)."""
    data = bytearray(path.read_bytes())
    conts = list(containers(data, *nv_fatbin_section(data)))
    others = [e for *_x, ents in conts for e in ents if e[1] == KIND_ELF and e[3] != ARCH]
    f = min(others, key=lambda e: e[2]) if others else None
    filler = bytes(data[f[0]:f[0] + f[2]]) if f else b""
    before = after = 0
    kept_ptx = []
    for p, hsz, fsz, ents in conts:
        keep = [bytes(data[e[0]:e[0] + e[2]]) for e in ents if e[1] == KIND_ELF and e[3] == ARCH]
        ptx = [e for e in ents if e[1] == KIND_PTX and e[3] <= ARCH]
        if not keep and keep_ptx and ptx:
            e = max(ptx, key=lambda e: e[3])
            if any(keep_ptx.search(n) for n in ptx_entries(data, e)):
                keep = [bytes(data[e[0]:e[0] + e[2]])]
                kept_ptx.append(f"{path.name}@{p:#x}")
        blob = b"".join(keep) if keep else filler
        assert len(blob) <= fsz
        data[p + hsz:p + hsz + fsz] = blob + bytes(fsz - len(blob))
        struct.pack_into("<Q", data, p + 8, len(blob))
        before, after = before + fsz, after + len(blob)
    path.write_bytes(data)
    print(f"fatbin: {path.name}: CUDA fatbin {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")
    return kept_ptx


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python3 scripts/fatbin.py LIB.so [LIB.so ...]")
    for name in sys.argv[1:]:
        prune(Path(name))
