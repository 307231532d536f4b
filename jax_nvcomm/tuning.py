"""Tuning tables of the all-reduce strategy choice (`strategy.select_strategy`): per
(world size, op, dtype), up to which message size the one-shot and the two-shot kernels beat
XLA's collective and, at world size 1, from which size our fused kernel beats XLA's
add + RMSNorm. `python -m jax_nvcomm.tune` measures them on the machine at hand and writes a
tuning file; every `Communicator` reads its table once at setup, never at trace time.
The file format, the precedence and the variables: docs/tuning.md.

Where a communicator's table comes from, decided by process 0 of the job (every other process
gets process 0's table at setup, so all of them choose alike):
  1. JAX_NVCOMM_TUNING=FILE: that file, as given (JAX_NVCOMM_TUNING=builtin: the built-in
     table, the cache ignored);
  2. otherwise the cache file (`cache_path()`, written by `tune` by default) when the machine
     fingerprint recorded in it matches this machine's (`fingerprint`); a file of another
     machine is ignored with a note on stderr, once per process;
  3. otherwise the built-in table (jax_nvcomm/tuning_builtin.json, data like a tuning file).
A (world size, op, dtype) that the file has no row for falls back to the built-in table.
JAX_NVCOMM_ONESHOT_MAX_BYTES / JAX_NVCOMM_TWOSHOT_MAX_BYTES / JAX_NVCOMM_LOCAL_MIN_BYTES, read
by process 0 at setup too, override every row; keyword arguments of `select_strategy` override
those.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence

from . import _exchange, topology
from ._version import __version__

FORMAT = "jax_nvcomm.tuning/1"
OPS = ("all_reduce", "all_reduce_rms_norm", "all_reduce_rms_norm_quant")
DTYPES = ("bfloat16", "float16", "float32")
ANY = "*"
ENV_FILE = "JAX_NVCOMM_TUNING"
ENV_CACHE_DIR = "JAX_NVCOMM_CACHE_DIR"
ENV_OVERRIDES = {"oneshot_max_bytes": "JAX_NVCOMM_ONESHOT_MAX_BYTES",
                 "twoshot_max_bytes": "JAX_NVCOMM_TWOSHOT_MAX_BYTES",
                 "local_min_bytes": "JAX_NVCOMM_LOCAL_MIN_BYTES"}
# fingerprint keys that must be equal for a cache file to apply ("link" is compared too, unless
# either side could not tell it: a process that sees one GPU)
MATCH_KEYS = ("platform", "device_kind", "device_count", "driver", "jax", "jaxlib",
              "jax_nvcomm")
UNKNOWN_LINK = "unknown"
_BUILTIN_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning_builtin.json")


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a tuning table. `op` / `dtype` may be "*" (any). World size >= 2: one-shot
    up to `oneshot_max_bytes`, two-shot up to `twoshot_max_bytes`, XLA above. World size 1
    (no communication): our kernel from `local_min_bytes` on (None: never), XLA below."""
    world_size: int
    op: str
    dtype: str
    oneshot_max_bytes: int
    twoshot_max_bytes: int
    local_min_bytes: int | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def label(self) -> str:
        return f"world {self.world_size}, {self.op}, {self.dtype}"


def _int_field(r, key, where, *, optional=False):
    v = r.get(key) if optional else r[key]
    if optional and v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{where}: {key} must be an int >= 0{' or null' if optional else ''}, "
                         f"got {v!r}")
    return v


def parse_row(r, where: str) -> Row:
    """A Row from a JSON object (extra keys, e.g. "note", are kept out); ValueError naming the
    field, the expected and the actual value."""
    if not isinstance(r, Mapping):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(r).__name__}")
    missing = [k for k in ("world_size", "op", "dtype", "oneshot_max_bytes",
                           "twoshot_max_bytes") if k not in r]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    w = r["world_size"]
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"{where}: world_size must be an int >= 1, got {w!r}")
    if r["op"] not in OPS + (ANY,):
        raise ValueError(f"{where}: op must be one of {', '.join(OPS + (ANY,))}, got "
                         f"{r['op']!r}")
    if r["dtype"] not in DTYPES + (ANY,):
        raise ValueError(f"{where}: dtype must be one of {', '.join(DTYPES + (ANY,))}, got "
                         f"{r['dtype']!r}")
    return Row(w, r["op"], r["dtype"], _int_field(r, "oneshot_max_bytes", where),
               _int_field(r, "twoshot_max_bytes", where),
               _int_field(r, "local_min_bytes", where, optional=True))


def parse_rows(rows, where: str) -> tuple[Row, ...]:
    """Rows from a JSON list; a (world size, op, dtype) given twice is an error."""
    if not isinstance(rows, list):
        raise ValueError(f"{where}: \"allreduce\" must be a list of rows, got "
                         f"{type(rows).__name__}")
    out, seen = [], {}
    for i, r in enumerate(rows):
        row = parse_row(r, f"{where}: allreduce[{i}]")
        key = (row.world_size, row.op, row.dtype)
        if key in seen:
            raise ValueError(f"{where}: allreduce[{i}] repeats allreduce[{seen[key]}] "
                             f"({row.label()})")
        seen[key] = i
        out.append(row)
    return tuple(out)


def validate(doc, where: str) -> dict:
    """The checked content of a tuning file: {"machine": dict, "rows": (Row, ...)}."""
    if not isinstance(doc, Mapping):
        raise ValueError(f"{where}: a tuning file is a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise ValueError(f"{where}: format must be {FORMAT!r}, got {doc.get('format')!r}")
    machine = doc.get("machine")
    if machine is not None and not isinstance(machine, Mapping):
        raise ValueError(f"{where}: machine must be a JSON object or null, got "
                         f"{type(machine).__name__}")
    if "allreduce" not in doc:
        raise ValueError(f"{where}: missing \"allreduce\" (the list of rows)")
    return {"machine": dict(machine or {}), "rows": parse_rows(doc["allreduce"], where)}


_loaded: dict = {}


def load(path: str) -> dict:
    """Read and check a tuning file (once per process and file version).

    Args:
      path: the JSON file.

    Returns:
      {"machine": its fingerprint dict ({} when null), "rows": (Row, ...)}.

    Raises:
      ValueError: the file is missing, unreadable, not JSON or not a valid tuning file (the
        message names the file, the field, the expected and the actual value).
    """
    where = f"jax_nvcomm: tuning file {path}"
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror or e})") from e
    key = (os.path.abspath(path), st.st_mtime_ns, st.st_size)
    if key not in _loaded:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{where}: cannot read it ({e})") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from e
        _loaded[key] = validate(doc, where)
    return _loaded[key]


def builtin_rows() -> tuple[Row, ...]:
    """The built-in table (jax_nvcomm/tuning_builtin.json)."""
    return load(_BUILTIN_FILE)["rows"]


def cache_dir(env: Mapping[str, str] | None = None) -> str:
    """JAX_NVCOMM_CACHE_DIR, else $XDG_CACHE_HOME/jax_nvcomm, else ~/.cache/jax_nvcomm."""
    env = os.environ if env is None else env
    if env.get(ENV_CACHE_DIR):
        return env[ENV_CACHE_DIR]
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jax_nvcomm")


def cache_path(env: Mapping[str, str] | None = None) -> str:
    """Where `tune` writes by default and communicators look for a table of this machine."""
    return os.path.join(cache_dir(env), "tuning.json")


# ------------------------------------------------------------------------------ the machine
def _host_gpu_count() -> int | None:
    """The GPUs of this host as the driver lists them, whatever CUDA_VISIBLE_DEVICES says (the
    launcher gives each process one): /proc/driver/nvidia/gpus, else `nvidia-smi -L`."""
    try:
        n = len(os.listdir("/proc/driver/nvidia/gpus"))
        if n:
            return n
    except OSError:
        pass
    from ._platform import nvidia_gpus
    return len(nvidia_gpus()) or None


def _driver_version() -> str | None:
    """The NVIDIA kernel driver's version (/proc/driver/nvidia/version), else the CUDA
    version the driver supports (cuda-python), else None."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as f:
            m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+([0-9][0-9.]*)", f.read())
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        d = topology._driver()
        return f"cuda {int(topology._call(d, d.cuDriverGetVersion))}"
    except Exception:  # noqa: BLE001 - no cuda-python / no driver: unknown
        return None


def _gpu_link(devices) -> str:
    """The link among these GPUs of one process: "nvlink", "pcie", "none", "mixed (...)", or
    "unknown" (one GPU visible, or no cuda-python)."""
    ords = sorted({int(d.local_hardware_id) for d in devices})
    if len(ords) < 2:
        return UNKNOWN_LINK
    try:
        rep = topology.report(ords)
    except Exception:  # noqa: BLE001
        return UNKNOWN_LINK
    links = sorted(set(rep.get("links", {}).values()))
    if not links or "error" in rep:
        return UNKNOWN_LINK
    return links[0] if len(links) == 1 else f"mixed ({', '.join(links)})"


_fingerprints: dict = {}


def fingerprint(devices: Sequence | None = None) -> dict:
    """This machine as a tuning file records it (computed once per process and device set).

    Args:
      devices: this process's devices of one platform (default `jax.local_devices()`).

    Returns:
      {platform, device_kind (the GPU's name), device_count (GPUs of the host as the driver
      lists them; on CPU the local devices), link ("nvlink", "pcie", ..., "unknown" with one
      GPU visible; "host memory" on CPU), driver (None on CPU), jax, jaxlib, jax_nvcomm}.
    """
    import jax
    import jaxlib
    devs = list(jax.local_devices() if devices is None else devices)
    key = tuple(d.id for d in devs)
    if key in _fingerprints:
        return dict(_fingerprints[key])
    gpu = devs[0].platform != "cpu"
    fp = dict(platform=devs[0].platform, device_kind=devs[0].device_kind,
              device_count=(_host_gpu_count() or len(devs)) if gpu else len(devs),
              link=_gpu_link(devs) if gpu else "host memory",
              driver=_driver_version() if gpu else None,
              jax=jax.__version__, jaxlib=jaxlib.__version__, jax_nvcomm=__version__)
    _fingerprints[key] = fp
    return dict(fp)


def mismatch(saved: Mapping, here: Mapping) -> list[str]:
    """How the machine of a tuning file differs from this one ([] when the file applies)."""
    out = [f"{k} {saved.get(k)!r} there, {here.get(k)!r} here" for k in MATCH_KEYS
           if saved.get(k) != here.get(k)]
    a, b = saved.get("link"), here.get("link")
    if a != b and UNKNOWN_LINK not in (a, b):
        out.append(f"link {a!r} there, {b!r} here")
    return out


# ------------------------------------------------------------------------------ the table
def _specificity(r: Row) -> int:
    return 2 * (r.op != ANY) + (r.dtype != ANY)


def pick(rows: Sequence[Row], world: int, op: str, dtype: str,
         beyond: bool = False) -> Row | None:
    """The row of `rows` for (world, op, dtype): among rows matching op and dtype (or "*"),
    those of the largest world size <= world, the most specific of them. Without `beyond`,
    None for a world larger than every matching row's (a file tuned on fewer GPUs says
    nothing about more); the built-in table extends its largest row."""
    cands = [r for r in rows if r.op in (op, ANY) and r.dtype in (dtype, ANY)]
    below = [r.world_size for r in cands if r.world_size <= world]
    if not below or (not beyond and world > max(r.world_size for r in cands)):
        return None
    w = max(below)
    return max((r for r in cands if r.world_size == w), key=_specificity)


@dataclasses.dataclass(frozen=True)
class Table:
    """A communicator's tuning: the rows of its source ("file", "cache" or "built-in"), the
    built-in rows behind them, and the environment's overrides read at setup."""
    source: str
    path: str | None = None
    rows: tuple[Row, ...] = ()
    builtin: tuple[Row, ...] = ()
    overrides: tuple[tuple[str, int], ...] = ()

    def describe(self) -> str:
        if self.source == "file":
            return f"tuning file {self.path} ({ENV_FILE})"
        if self.source == "cache":
            return f"tuning cache {self.path} (this machine's fingerprint)"
        return "built-in table"

    def lookup(self, world: int, op: str, dtype: str) -> tuple[Row | None, str]:
        """(row, what it came from) for (world, op, dtype): the source's row, else the
        built-in one."""
        if self.source != "built-in":
            r = pick(self.rows, world, op, dtype)
            if r is not None:
                return r, self.describe()
        r = pick(self.builtin, world, op, dtype, beyond=True)
        what = "built-in table"
        if self.source != "built-in":
            what += f" (the {self.source} has no row for world {world}, {op}, {dtype})"
        return r, what

    def to_json(self) -> dict:
        return dict(source=self.source, path=self.path,
                    rows=[r.to_dict() for r in self.rows],
                    builtin=[r.to_dict() for r in self.builtin],
                    overrides=[list(kv) for kv in self.overrides])

    @classmethod
    def from_json(cls, d: Mapping) -> Table:
        return cls(source=d["source"], path=d["path"],
                   rows=parse_rows(d["rows"], "shared tuning table"),
                   builtin=parse_rows(d["builtin"], "shared built-in table"),
                   overrides=tuple((str(k), int(v)) for k, v in d["overrides"]))


def _say_once(msg: str) -> None:
    topology._say_once(msg)


def env_overrides(env: Mapping[str, str]) -> tuple[tuple[str, int], ...]:
    """The thresholds the environment sets ((field, bytes), ...); ValueError naming a bad one."""
    out = []
    for field, var in ENV_OVERRIDES.items():
        text = env.get(var, "").strip()
        if not text:
            continue
        try:
            v = int(text, 0)
        except ValueError:
            v = -1
        if v < 0:
            raise ValueError(f"jax_nvcomm: {var} must be an int >= 0 (bytes), got {text!r}")
        out.append((field, v))
    return tuple(out)


def resolve(env: Mapping[str, str] | None = None, devices: Sequence | None = None) -> Table:
    """This process's table (see the module docstring): JAX_NVCOMM_TUNING, else the cache
    file when it matches `fingerprint(devices)`, else the built-in table; plus the
    environment's overrides.

    Args:
      env: the environment to read (default os.environ).
      devices: the devices whose machine the cache file must match (`fingerprint`).

    Returns:
      A `Table`.

    Raises:
      ValueError: JAX_NVCOMM_TUNING names a file that is missing or invalid, or an override
        variable is not a byte count. (A bad cache file is ignored with a note instead.)
    """
    env = os.environ if env is None else env
    over = env_overrides(env)
    base = builtin_rows()
    name = env.get(ENV_FILE, "").strip()
    if name.lower() == "builtin":
        return Table("built-in", None, (), base, over)
    if name:
        return Table("file", os.path.abspath(name), load(name)["rows"], base, over)
    path = cache_path(env)
    if not os.path.exists(path):
        return Table("built-in", None, (), base, over)
    try:
        doc = load(path)
    except ValueError as e:
        _say_once(f"{e}; ignored (the built-in table applies)")
        return Table("built-in", None, (), base, over)
    diff = mismatch(doc["machine"], fingerprint(devices))
    if diff:
        _say_once(f"jax_nvcomm: ignoring the tuning cache {path}: it was tuned on another "
                  f"machine ({'; '.join(diff)}); the built-in table applies. `python -m "
                  "jax_nvcomm.tune` tunes this one")
        return Table("built-in", None, (), base, over)
    return Table("cache", path, doc["rows"], base, over)


def shared(prefix: str, timeout_s: float, devices: Sequence | None = None) -> Table:
    """Process 0's `resolve()`, in every process of the job (through the key-value store at
    communicator setup; other processes read no file).

    Args:
      prefix: the communicator's key prefix in the key-value store.
      timeout_s: bound on the wait for process 0.
      devices: as in `resolve` (used by process 0).

    Returns:
      Process 0's `Table`.

    Raises:
      ValueError: in process 0, as `resolve`.
      RuntimeError: in the other processes, naming process 0's failure; a process 0 that
        never publishes (after `timeout_s`).
    """
    def make():
        return json.dumps(resolve(devices=devices).to_json())

    text = _exchange.from_process0(f"{prefix}/tuning", make, timeout_s,
                                   "process 0's tuning table")
    return Table.from_json(json.loads(text))
