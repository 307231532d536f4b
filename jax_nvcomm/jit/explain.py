"""`jax_nvcomm.explain(fun, *args, **kwargs)`: every collective of a program and what
`jax_nvcomm.jit` made of it.

Two sources: the rewrite's own decisions (one `rewrite.Site` per collective inside a
shard_map and per replaced op: source line, op, shape, dtype, axes and their mesh, our kernel
and strategy or XLA, and why), and the compiled program's HLO, for the collectives XLA's SPMD
partitioner inserts for sharded arrays outside any shard_map (pjit-style code): those are out
of nvc.jit's reach, and the row says how to bring them in. Their axes are read back from the
replica groups (`axes`), their line from the stack frame chain (`userline`, the same rule as
the Sites': the user's line, past the model's thin helpers).
"""
from __future__ import annotations

import re

from . import entry as _jit
from . import userline
from .axes import attribute, groups_of, match, mesh_label
from . import regions as _regions

_HLO_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<shape>.+?)\s+(?P<op>all-reduce|all-gather|reduce-scatter|"
    r"all-to-all|collective-permute|ragged-all-to-all|all-reduce-start|all-gather-start|"
    r"collective-permute-start)\((?P<rest>.*)$")
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(?P<id>\d+)")
_OURS = ("psum", "psum_invariant", "all_gather", "reduce_scatter", "psum_scatter",
         "ragged_all_to_all", "all_to_all", "ppermute", "pbroadcast", "all_gather_invariant")
_LOCAL_OPS = ("ragged_dot",)   # replaced ops that are not collectives
WAY_IN = ("inserted by XLA's SPMD partitioner for {what} on arrays sharded outside any "
          "shard_map: out of nvc.jit's reach. The way in: compute that part inside a "
          "jax.shard_map region and write the collective there (lax.psum / lax.all_gather / "
          "lax.psum_scatter), which nvc.jit then serves (docs/guide.md, 'Adopting in model "
          "code')")


def _frames(text: str) -> dict:
    """{stack frame id: its chain of frames, innermost first} from an HLO module's FileNames /
    FunctionNames / FileLocations / StackFrames tables (a frame's printed parent_frame_id is
    its parent's id + 1; 0: none)."""
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
    funcs = {k: v.strip('"') for k, v in sections.get("FunctionNames", {}).items()}
    locs = {}
    for k, v in sections.get("FileLocations", {}).items():
        f = re.search(r"file_name_id=(\d+)", v)
        fn = re.search(r"function_name_id=(\d+)", v)
        ln = re.search(r"\bline=(\d+)", v)
        if f and ln:
            locs[k] = userline.Frame(files.get(int(f.group(1)), "?"), int(ln.group(1)),
                                     funcs.get(int(fn.group(1)), "?") if fn else "?")
    table = {}
    for k, v in sections.get("StackFrames", {}).items():
        m = re.search(r"file_location_id=(\d+)", v)
        p = re.search(r"parent_frame_id=(\d+)", v)
        table[k] = (locs.get(int(m.group(1))) if m else None, int(p.group(1)) - 1 if p else 0)
    out = {}
    for k in table:
        chain, seen, j = [], set(), k
        while j in table and j not in seen:
            seen.add(j)
            frame, parent = table[j]
            if frame is not None:
                chain.append(frame)
            j = parent
        out[k] = chain
    return out


def _split_top(s: str, sep: str) -> list[str]:
    """s split at `sep` outside parentheses."""
    parts, depth, cur = [], 0, ""
    for c in s:
        depth += (c == "(") - (c == ")")
        if c == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    return parts + [cur]


def _parts(op_name: str) -> list[str]:
    """The ops an HLO collective stands for, each its op_name's last path component: XLA's
    combiners join the names of the ops they merge as "prefix/(a:b:c)", where each name is a
    path of its own ("jit(f)/jit(norm)/reduce_sum")."""
    names = [op_name]
    if op_name.endswith(")"):
        depth = 0
        for i in range(len(op_name) - 1, -1, -1):
            depth += (op_name[i] == ")") - (op_name[i] == "(")
            if depth == 0:
                if i == 0 or op_name[i - 1] == "/":
                    names = _split_top(op_name[i + 1:-1], ":")
                break
    out = []
    for n in names:
        last = [p for p in _split_top(n.strip(), "/") if p]
        if last:
            out.append(last[-1])
    return out


def hlo_collectives(text: str, device_ids=None, meshes=(), sites=()) -> list[dict]:
    """Rows for the collectives of a compiled HLO module's text that stand for no
    collective of the program's shard_maps (so XLA's partitioner put them there).

    `device_ids`: the device id of each index of the program's device assignment (default:
    0, 1, ...); `meshes`: the program's meshes, whose axis names label the rows' groups
    (`axes`); `sites`: the rewrite's Sites (a row on a Site's line takes its mesh first)."""
    frames = _frames(text)
    by_line: dict = {}
    for s in sites:
        if getattr(s, "mesh_obj", None) is not None:
            by_line.setdefault(s.source, []).append(s.mesh_obj)
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
        chain = frames.get(int(fid.group("id")), []) if fid else []
        frame, stack = userline.choose([(f, not userline.is_ours(f.file)) for f in chain])
        source = frame.short() if frame is not None else "?"
        shape = m.group("shape")
        dt = re.match(r"\(?\s*([a-z0-9]+)\[", shape)
        axes, mesh = _named_axes(attribute(rest, "replica_groups"), device_ids, meshes,
                                 by_line.get(source, ()))
        rows.append(dict(
            op=m.group("op"), source=source, shape=shape, dtype=dt.group(1) if dt else "?",
            axes=axes, became="xla (out of reach)", fused_with="",
            reason=WAY_IN.format(what=", ".join(sorted(set(outside)))), fixable=False,
            mesh=mesh, stack=tuple(f.long() for f in stack)))
    return rows


def _named_axes(groups_text, device_ids, meshes, prefer):
    """(axes, mesh label) of an HLO collective's replica_groups: the model's names where a
    mesh of the program has those groups, else the text as XLA printed it."""
    if not groups_text:
        return (), ""
    n = len(device_ids) if device_ids is not None else None
    if device_ids is None:
        n = max((m.devices.size for m in meshes if hasattr(m, "devices")), default=0)
        device_ids = list(range(n))
    groups, printed = groups_of(groups_text, n)
    if groups is None:
        return groups_text, ""
    named = [m for m in meshes if tuple(getattr(m, "axis_names", ())) == printed]
    hit = match(groups, list(device_ids), list(meshes), prefer=list(prefer) + named)
    if hit is None:
        return groups_text, ""
    return hit[1], mesh_label(hit[0])


_COLS = ("source", "op", "shape", "dtype", "axes", "mesh", "became", "fused_with")


def _cell(r, c) -> str:
    v = r.get(c, "")
    if c == "axes" and isinstance(v, tuple):
        return ",".join(str(a) for a in v)
    if isinstance(v, tuple):
        v = list(v)
    v = str(v)
    return v if len(v) <= 48 or c != "shape" else v[:45] + "..."


class Explanation:
    """What `explain` returns: `rows` (a list of dicts with keys source, op, shape, dtype,
    axes, mesh, became, fused_with, reason, fixable, stack), printable as a table (`str()`,
    `format(stack=True)` with each row's user frames under it)."""

    def __init__(self, rows, program_text=""):
        self.rows = list(rows)
        self.program_text = program_text

    @property
    def ours(self) -> list[dict]:
        """The rows replaced by our ops (collectives, fused ones included, and ragged_dot)."""
        return [r for r in self.rows if not r["became"].startswith(("xla", "lax", "?"))]

    @property
    def xla(self) -> list[dict]:
        return [r for r in self.rows if r["became"].startswith("xla")]

    def summary(self) -> str:
        local = [r for r in self.rows if r["op"] in _LOCAL_OPS]
        coll = [r for r in self.rows if r["op"] not in _LOCAL_OPS]
        ours = [r for r in coll if r in self.ours]
        fused = sum(1 for r in ours if r["fused_with"])
        xla = [r for r in coll if r["became"].startswith("xla")]
        out = sum(1 for r in xla if r["became"] == "xla (out of reach)")
        text = (f"{len(coll)} collectives: {len(ours)} on jax_nvcomm's kernels "
                f"({fused} fused with add + RMSNorm), {len(xla)} XLA's ({out} inserted by "
                "XLA outside any shard_map)")
        if local:
            mine = [r for r in local if r in self.ours]
            text += (f"; {len(local)} ragged_dot: {len(mine)} on jax_nvcomm's kernel; "
                     f"{len(self.ours)} replacements in all")
        return text

    def format(self, stack: bool = False) -> str:
        """The table (one row per collective or replaced op, its reason last) and the
        summary; `stack=True`: each row's user frames, innermost first, under it."""
        table = [[_cell(r, c) for c in _COLS] for r in self.rows]
        widths = [max([len(c)] + [len(t[i]) for t in table]) for i, c in enumerate(_COLS)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(_COLS, widths)) + "  reason"]
        for r, t in zip(self.rows, table):
            lines.append("  ".join(v.ljust(w) for v, w in zip(t, widths)) + "  " +
                         str(r.get("reason", "")))
            if stack:
                lines.extend(f"    at {f}" for f in r.get("stack", ()))
        return "\n".join(lines + [self.summary()])

    def __str__(self) -> str:
        return self.format()

    __repr__ = __str__


def explain(fun, *args, **kwargs) -> Explanation:
    """Every collective of `fun`'s program on these arguments and what `jax_nvcomm.jit`
    makes of it.

    Args:
      fun: a function (as given to `jit`) or what `jax_nvcomm.jit` returned.
      *args, **kwargs: arguments as for the call (arrays or `jax.ShapeDtypeStruct`s);
        communicators the program needs are made, as at its first call.

    Returns:
      An `Explanation`: `print()` it for a table (`.format(stack=True)`: with each row's
      call stack); `.rows` lists one dict per collective and per replaced `ragged_dot`:
      `source` (file:line of the user's call: the first frame outside jax, jax_nvcomm and
      the model's thin helpers, `userline`), `op` (lax's name; HLO's for those XLA
      inserts), `shape`, `dtype`, `axes` (the model's axis names), `mesh` (the mesh they are
      axes of, "mesh(data=4, model=2)": the shard_map's own), `became` ("all_reduce
      (oneshot)", "all_reduce_rms_norm (twoshot)", "all_gather", "reduce_scatter_v",
      "ragged_all_to_all", ..., or "xla"; "xla (out of reach)" for collectives XLA's
      partitioner inserts outside any shard_map), `fused_with` (the add and norm a fused
      call took in, with their lines), `reason` (the strategy table's choice, or why XLA's
      collective stays), `fixable` (a reason the caller can change), `stack` (every user
      frame of the call, innermost first, "file:line (function)").
    """
    jitted = fun if isinstance(fun, _jit.Jitted) else _jit.Jitted(fun, {})
    sites, lowered = jitted.explain_rows(*args, **kwargs)
    rows = [s.row() for s in sites]
    text = ""
    try:
        text = lowered.compile().as_text()
    except Exception as e:  # noqa: BLE001 - the rows of the rewrite still stand
        rows.append(dict(op="?", source="?", shape=(), dtype="?", axes=(), mesh="",
                         became="?", fused_with="", reason=_sentence(
                             f"the program did not compile here: {e}"), fixable=False,
                         stack=()))
    devices = getattr(getattr(lowered, "_lowering", None), "_device_list", None)
    ids = [d.id for d in devices] if devices is not None else None
    closed = jitted._p()._trace(args, kwargs)[0]  # products sharded by type not cut
    rows.extend(_regions.annotate(
        hlo_collectives(text, ids, _meshes(sites, args, kwargs, lowered), sites), closed))
    return Explanation(rows, text)


def _sentence(text: str, limit: int = 400) -> str:
    """text cut at a word boundary when longer than `limit` (an error's first lines)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def _meshes(sites, args, kwargs, lowered) -> list:
    """The program's concrete meshes, in the order a row's groups try them: the arguments'
    and results' shardings' (XLA's own collectives work on those), the shard_maps' (program
    order), the context's."""
    import jax
    shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves((args, kwargs))]
    try:
        ca = lowered._lowering.compile_args
        shardings += list(ca.get("in_shardings") or ()) + list(ca.get("out_shardings") or ())
    except AttributeError:
        pass
    out = [getattr(s, "mesh", None) for s in shardings]
    out += [s.mesh_obj for s in sites if getattr(s, "mesh_obj", None) is not None]
    try:
        from jax._src import mesh as mesh_lib
        out.append(mesh_lib.get_concrete_mesh())
    except Exception:  # noqa: BLE001 - a jax without it
        pass
    return [m for m in out if isinstance(m, jax.sharding.Mesh) and not m.empty]
