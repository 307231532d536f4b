"""Retag a linux_x86_64 wheel as manylinux_2_<N>_x86_64, N the newest glibc symbol version its
compiled modules need (at least 17), when auditwheel is unavailable (scripts/build_wheel.sh).
It copies no libraries in and does not check libstdc++'s symbol versions as auditwheel does:
the fallback of a machine without network, not the release path.

    python scripts/retag_wheel.py WHEEL OUT_DIR
"""
from __future__ import annotations

import base64
import hashlib
import os
import re
import sys
import zipfile


def glibc_minor(data: bytes) -> int:
    """The newest GLIBC_2.N version a shared object's symbol references name (17 if none
    newer)."""
    return max([17] + [int(m) for m in re.findall(rb"GLIBC_2\.(\d+)", data)])


def retag(wheel: str, out_dir: str) -> str:
    name = os.path.basename(wheel)
    if not name.endswith("-linux_x86_64.whl"):
        raise SystemExit(f"retag_wheel: expected a linux_x86_64 wheel, got {name}")
    with zipfile.ZipFile(wheel) as z:
        entries = [(i, z.read(i.filename)) for i in z.infolist()]
    minor = max(glibc_minor(d) for i, d in entries if i.filename.endswith(".so"))
    plat = f"manylinux_2_{minor}_x86_64"
    new_name = name[: -len("linux_x86_64.whl")] + plat + ".whl"
    record_name = next(i.filename for i, _ in entries if i.filename.endswith(".dist-info/RECORD"))
    rows = []
    out = os.path.join(out_dir, new_name)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for info, data in entries:
            if info.filename == record_name:
                continue
            if info.filename.endswith(".dist-info/WHEEL"):
                data = data.replace(b"-linux_x86_64", b"-" + plat.encode())
            z.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append(f"{info.filename},sha256={digest.decode()},{len(data)}")
        rows.append(f"{record_name},,")
        z.writestr(record_name, "\n".join(rows) + "\n")
    return out


if __name__ == "__main__":
    print(retag(sys.argv[1], sys.argv[2]))
