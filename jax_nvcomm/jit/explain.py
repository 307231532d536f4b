"""`jax_nvcomm.explain(fun, *args, **kwargs)`: every collective of a program and what
`jax_nvcomm.jit` made of it.

Two sources: the rewrite's own decisions (one `_rewrite.Site` per collective inside a
shard_map: source line, op, shape, dtype, axes, our kernel and strategy or XLA, and why), and
the compiled program's HLO, for the collectives XLA's SPMD partitioner inserts for sharded
arrays outside any shard_map (pjit-style code): those are out of nvc.jit's reach, and the row
says how to bring them in.
"""
from __future__ import annotations

import re

from . import entry as _jit
from . import regions as _regions

_HLO_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<shape>.+?)\s+(?P<op>all-reduce|all-gather|reduce-scatter|"
    r"all-to-all|collective-permute|ragged-all-to-all|all-reduce-start|all-gather-start|"
    r"collective-permute-start)\((?P<rest>.*)$")
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(?P<id>\d+)")
_GROUPS = re.compile(r"replica_groups=(?P<g>\S+(?: \{[^}]*\})?)")
_OURS = ("psum", "psum_invariant", "all_gather", "reduce_scatter", "psum_scatter",
         "ragged_all_to_all", "all_to_all", "ppermute", "pbroadcast", "all_gather_invariant")
WAY_IN = ("inserted by XLA's SPMD partitioner for {what} on arrays sharded outside any "
          "shard_map: out of nvc.jit's reach. The way in: compute that part inside a "
          "jax.shard_map region and write the collective there (lax.psum / lax.all_gather / "
          "lax.psum_scatter), which nvc.jit then serves (docs/guide.md, 'Adopting in model "
          "code')")


def _frames(text: str) -> dict:
    """{stack frame id: "file:line"} from an HLO module's FileNames / FileLocations /
    StackFrames tables."""
    import os
    sections: dict = {}
    current = None
    for line in text.splitlines():
        s = line.strip()
        if s in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = sections.setdefault(s, {})
            continue
        if not s or s.startswith("%") or s.startswith("HloModule") or s.startswith("ENTRY"):
            if s:
                current = None
            continue
        if current is not None:
            k, _, v = s.partition(" ")
            if k.isdigit():
                current[int(k)] = v
    files = {k: v.strip('"') for k, v in sections.get("FileNames", {}).items()}
    locs = {}
    for k, v in sections.get("FileLocations", {}).items():
        f = re.search(r"file_name_id=(\d+)", v)
        ln = re.search(r"\bline=(\d+)", v)
        if f and ln:
            locs[k] = f"{os.path.basename(files.get(int(f.group(1)), '?'))}:{ln.group(1)}"
    out = {}
    for k, v in sections.get("StackFrames", {}).items():
        m = re.search(r"file_location_id=(\d+)", v)
        if m:
            out[k] = locs.get(int(m.group(1)), "?")
    return out


def _parts(op_name: str) -> list[str]:
    """The ops an HLO collective stands for: XLA's combiners join their names as
    "prefix/(a:b:c)"; each part's last path component."""
    m = re.search(r"\(([^()]*)\)\s*$", op_name)
    names = m.group(1).split(":") if m else [op_name]
    return [n.rstrip("/").split("/")[-1] for n in names if n]


def hlo_collectives(text: str) -> list[dict]:
    """Rows for the collectives of a compiled HLO module's text that stand for no
    collective of the program's shard_maps (so XLA's partitioner put them there)."""
    frames = _frames(text)
    rows = []
    for line in text.splitlines():
        m = _HLO_COLLECTIVE.match(line)
        if not m:
            continue
        rest = m.group("rest")
        name = _OP_NAME.search(rest)
        parts = _parts(name.group("name")) if name else ["?"]
        outside = [p for p in parts if p not in _OURS]
        if not outside:
            continue  # a shard_map collective that stayed XLA's: its Site row says why
        fid = _FRAME_ID.search(rest)
        groups = _GROUPS.search(rest)
        shape = m.group("shape")
        dt = re.match(r"\(?\s*([a-z0-9]+)\[", shape)
        rows.append(dict(
            op=m.group("op"), source=frames.get(int(fid.group("id")), "?") if fid else "?",
            shape=shape, dtype=dt.group(1) if dt else "?",
            axes=groups.group("g") if groups else "", became="xla (out of reach)",
            fused_with="", reason=WAY_IN.format(what=", ".join(sorted(set(outside)))),
            fixable=False))
    return rows


class Explanation:
    """What `explain` returns: `rows` (a list of dicts with keys source, op, shape, dtype,
    axes, became, fused_with, reason, fixable), printable as a table (`str()`)."""

    def __init__(self, rows, program_text=""):
        self.rows = list(rows)
        self.program_text = program_text

    @property
    def ours(self) -> list[dict]:
        return [r for r in self.rows if not r["became"].startswith("xla")]

    @property
    def xla(self) -> list[dict]:
        return [r for r in self.rows if r["became"].startswith("xla")]

    def summary(self) -> str:
        fused = sum(1 for r in self.ours if r["fused_with"])
        out = sum(1 for r in self.rows if r["became"] == "xla (out of reach)")
        return (f"{len(self.rows)} collectives: {len(self.ours)} on jax_nvcomm's kernels "
                f"({fused} fused with add + RMSNorm), {len(self.xla)} XLA's ({out} inserted by "
                "XLA outside any shard_map)")

    def __str__(self) -> str:
        cols = ("source", "op", "shape", "dtype", "axes", "became", "fused_with", "reason")
        table = [[str(r[c]) if c != "shape" else
                  (str(list(r[c])) if isinstance(r[c], tuple) else str(r[c])) for c in cols]
                 for r in self.rows]
        widths = [max([len(c)] + [min(len(t[i]), 48) for t in table]) for i, c in
                  enumerate(cols[:-1])]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cols[:-1], widths)) + "  reason"]
        for t in table:
            lines.append("  ".join(v[:48].ljust(w) for v, w in zip(t[:-1], widths)) + "  " +
                         t[-1])
        return "\n".join(lines + [self.summary()])

    __repr__ = __str__


def explain(fun, *args, **kwargs) -> Explanation:
    """Every collective of `fun`'s program on these arguments and what `jax_nvcomm.jit`
    makes of it.

    Args:
      fun: a function (as given to `jit`) or what `jax_nvcomm.jit` returned.
      *args, **kwargs: arguments as for the call (arrays or `jax.ShapeDtypeStruct`s);
        communicators the program needs are made, as at its first call.

    Returns:
      An `Explanation`: `print()` it for a table; `.rows` lists one dict per collective:
      `source` (file:line of the call), `op` (lax's name; HLO's for those XLA inserts),
      `shape`, `dtype`, `axes`, `became` ("all_reduce (oneshot)", "all_reduce_rms_norm
      (twoshot)", "all_gather", "ragged_all_to_all", ..., or "xla"; "xla (out of reach)" for
      collectives XLA's partitioner inserts outside any shard_map), `fused_with` (the add
      and norm a fused call took in, with their lines), `reason` (the strategy table's
      choice, or why XLA's collective stays), `fixable` (a reason the caller can change).
    """
    jitted = fun if isinstance(fun, _jit.Jitted) else _jit.Jitted(fun, {})
    sites, lowered = jitted.explain_rows(*args, **kwargs)
    rows = [s.row() for s in sites]
    text = ""
    try:
        text = lowered.compile().as_text()
    except Exception as e:  # noqa: BLE001 - the rows of the rewrite still stand
        rows.append(dict(op="?", source="?", shape=(), dtype="?", axes=(), became="?",
                         fused_with="", reason=f"the program did not compile here: {e}",
                         fixable=False))
    closed = jitted._trace(args, kwargs)[0]  # products sharded by type that were not cut
    rows.extend(_regions.annotate(hlo_collectives(text), closed))
    return Explanation(rows, text)
