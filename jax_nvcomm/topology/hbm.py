"""The peak memory bandwidth of a GPU, the denominator of every weight-read bound the
benchmarks and the tuner print: a table of datasheet numbers by device name, else the device's
own memory clock x bus width x 2 (double data rate) from cuda-python's device attributes.

    peak_bytes_per_s(device) -> (bytes per second, where the number came from)
"""
from __future__ import annotations

# (words that must all appear in the device name, bytes/s, datasheet); the first match wins
# (the PCIe H100 before the SXM one: both names say H100)
TABLE = (
    (("H100", "PCIe"), 2.0e12, "H100 PCIe datasheet"),
    (("H100", "NVL"), None, None),   # 3.9 TB/s per datasheet: not in the table, ask the device
    (("H100",), 3.35e12, "H100 SXM datasheet"),
    (("H200",), 4.8e12, "H200 datasheet"),
    (("B200",), 8.0e12, "B200 datasheet"),
)


def from_table(name: str):
    """(bytes/s, source) of the table row whose words all appear in `name`, else None."""
    for words, bw, src in TABLE:
        if all(w.lower() in name.lower() for w in words):
            return None if bw is None else (bw, src)
    return None


def from_attributes(ordinal: int):
    """(bytes/s, source) from CUDA device `ordinal`'s memory clock (kHz) and bus width (bits),
    x 2 for double data rate; None without cuda-python or a driver."""
    try:
        from . import _call, _driver
        d = _driver()
        dev = _call(d, d.cuDeviceGet, ordinal)
        A = d.CUdevice_attribute
        khz = int(_call(d, d.cuDeviceGetAttribute, A.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE,
                        dev))
        bits = int(_call(d, d.cuDeviceGetAttribute,
                         A.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, dev))
    except Exception:  # noqa: BLE001 - no cuda-python, no driver: the caller says so
        return None
    if khz <= 0 or bits <= 0:
        return None
    return khz * 1e3 * bits / 8 * 2, (f"device attributes: memory clock {khz / 1e6:.3f} GHz x "
                                      f"{bits}-bit bus x 2")


def peak_bytes_per_s(device=None, override: float | None = None):
    """(bytes/s, source text) of `device` (a jax Device; default the first local one):
    `override` when given, else the table by device name, else the device's attributes; None
    for the number when none applies (a CPU device, no cuda-python)."""
    if override:
        return float(override), "--hbm-bytes-per-s"
    if device is None:
        import jax
        device = jax.local_devices()[0]
    name = getattr(device, "device_kind", "") or ""
    hit = from_table(name)
    if hit is not None:
        return hit[0], f"{hit[1]} ({name})"
    if getattr(device, "platform", "") == "gpu":
        hit = from_attributes(int(getattr(device, "local_hardware_id", 0) or 0))
        if hit is not None:
            return hit[0], f"{hit[1]} ({name})"
    return None, f"no peak bandwidth known for {name or 'this device'}"
