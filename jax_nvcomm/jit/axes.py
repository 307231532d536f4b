"""The model's names for what a collective spans, as `explain` prints them: a mesh's label
(its axis names and sizes), and the replica groups of a compiled HLO collective mapped back to
named axes of one of the program's meshes.

XLA prints an instruction's groups in one of three forms: a list (`{{0,1},{2,3}}`), an iota
(`[4,2]<=[8]`, `[2,4]<=[4,2]T(1,0)`), or a mesh (`mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`,
with jax's names or XLA's own `axis_i`). Each is read into its groups of device ids (indices
into the program's device assignment) and matched against the program's meshes: a mesh and
the fewest of its axes (size-1 axes left out) whose groups are those. Where several meshes
match (two meshes over the same devices), the one the caller prefers wins (the mesh of the
shard_map the row's line is in), then one whose names XLA printed, then the first.
"""
from __future__ import annotations

import itertools
import re

import numpy as np


def mesh_label(mesh) -> str:
    """"mesh(data=4, model=2)" for a jax Mesh or AbstractMesh; "" for None."""
    if mesh is None:
        return ""
    try:
        return "mesh(" + ", ".join(f"{n}={s}" for n, s in zip(mesh.axis_names,
                                                             mesh.axis_sizes)) + ")"
    except AttributeError:
        return str(mesh)


def attribute(text: str, key: str) -> str | None:
    """The value of `key=` in an HLO instruction's attribute list, up to the next comma
    outside brackets and quotes (values hold commas and spaces: `mesh['a'=4,'b'=2] {'b'}`)."""
    m = re.search(rf"\b{re.escape(key)}=", text)
    if not m:
        return None
    depth, quote, i = 0, False, m.end()
    while i < len(text):
        c = text[i]
        if c == "'":
            quote = not quote
        elif not quote:
            if c in "[{(":
                depth += 1
            elif c in "]})":
                depth -= 1
            elif c == "," and depth == 0:
                break
        i += 1
    return text[m.end():i].strip()


def _iota(dims, perm, shape):
    a = np.arange(int(np.prod(dims))).reshape(dims)
    if perm:
        a = a.transpose(perm)
    return a.reshape(shape)


def _ints(s):
    return [int(t) for t in s.split(",") if t.strip()]


def groups_of(value: str, n_devices: int) -> tuple[list[list[int]] | None, tuple]:
    """(groups of device indices, the axis names XLA printed) of a replica_groups value; None
    for a form not read."""
    value = value.strip()
    m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", value)
    if m:
        shape, dims = _ints(m.group(1)), _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) else None
        return _iota(dims, perm, shape).tolist(), ()
    m = re.fullmatch(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", value)
    if m:
        inner = m.group(1)
        axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", inner)
        if not axes or "<=" in inner or "(" in inner:
            return None, ()
        names = tuple(a for a, _ in axes)
        sizes = [int(s) for _, s in axes]
        chosen = re.findall(r"'([^']+)'", m.group(2))
        if any(c not in names for c in chosen) or int(np.prod(sizes)) != n_devices:
            return None, names
        a = np.arange(n_devices).reshape(sizes)
        keep = [i for i, nm in enumerate(names) if nm not in chosen]
        pick = [names.index(c) for c in chosen]
        a = a.transpose(keep + pick).reshape(-1, int(np.prod([sizes[i] for i in pick])))
        return a.tolist(), names
    if value.startswith("{"):
        inner = value[1:-1].strip()
        if not inner:
            return [list(range(n_devices))], ()
        gs = re.findall(r"\{([\d,\s]*)\}", inner)
        return ([_ints(g) for g in gs] if gs else None), ()
    return None, ()


def _mesh_groups(mesh, axes) -> set:
    ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices)
    idx = [mesh.axis_names.index(a) for a in axes]
    rest = [i for i in range(ids.ndim) if i not in idx]
    size = int(np.prod([ids.shape[i] for i in idx]))
    return {frozenset(g) for g in ids.transpose(rest + idx).reshape(-1, size).tolist()}


def match(groups, device_ids, meshes, prefer=()) -> tuple[object, tuple] | None:
    """(mesh, axes) among `meshes` (concrete jax Meshes) whose groups over `axes` are
    `groups` (device indices; `device_ids[i]` is index i's device id); `prefer`: meshes tried
    first. None when none matches."""
    try:
        want = {frozenset(device_ids[i] for i in g) for g in groups}
    except (IndexError, TypeError):
        return None
    seen, order = set(), []
    for m in list(prefer) + list(meshes):
        if m is not None and id(m) not in seen and hasattr(m, "devices"):
            seen.add(id(m))
            order.append(m)
    for mesh in order:
        names = [a for a in mesh.axis_names if mesh.shape[a] > 1]
        for k in range(1, len(names) + 1):
            for axes in itertools.combinations(names, k):
                if _mesh_groups(mesh, axes) == want:
                    return mesh, axes
    return None
