"""`python -m jax_nvcomm.bench ragged`: the exchange plan it derives from a routing moves every
(token, expert) row to its expert's rank and back (checked here by simulating
lax.ragged_all_to_all's contract in numpy), its routings are what they claim, and `--quick`
runs on 8 CPU devices with nvc.ragged_all_to_all equal to XLA's op bit for bit."""
import json

import numpy as np
import pytest

from jax_nvcomm.bench import cli
from jax_nvcomm.bench import ragged as br
from ragged_cases import np_ragged_all_to_all


def _simulate(operands, outputs, plan, pre):
    """lax.ragged_all_to_all's contract (one slice per peer) on numpy arrays, every rank
    (ragged_cases.np_ragged_all_to_all; it also checks that the receivers' recv sizes agree)."""
    return list(np_ragged_all_to_all(np.stack(operands), np.stack(outputs),
                                     *(plan[f"{pre}_{k}"] for k in ("in", "send", "out", "recv"))))


@pytest.mark.parametrize("world,experts,top_k,routing", [(4, 16, 4, "balanced"),
                                                        (4, 8, 8, "skewed"),
                                                        (1, 8, 2, "skewed")])
def test_exchange_plan_moves_every_row_to_its_expert_and_back(rng, world, experts, top_k,
                                                              routing):
    T = 12
    ids = np.stack([br.routing_ids(rng, T, experts, top_k, routing) for _ in range(world)])
    assert all((np.sort(i, 1)[:, 1:] != np.sort(i, 1)[:, :-1]).all() for i in ids)  # distinct
    plan = br.exchange_plan(ids, experts, world)
    L = experts // world
    # each rank's rows sorted by expert; a row carries (source rank, pair index, expert)
    sent, orders = [], []
    for s in range(world):
        order = np.argsort(ids[s].reshape(-1), kind="stable")
        orders.append(order)
        sent.append(np.stack([np.full(T * top_k, s), order, ids[s].reshape(-1)[order]], 1))
    M = int(plan["recv_rows"].max())
    got = _simulate(sent, [np.full((M, 3), -1) for _ in range(world)], plan, "disp")
    for d in range(world):
        n = plan["recv_rows"][d]
        assert (got[d][n:] == -1).all()
        assert (got[d][:n, 2] // L == d).all()              # only its own experts' rows
        assert (np.diff(got[d][:n, 0]) >= 0).all()          # in source order
        want = sorted((s, p) for s in range(world) for p, e in
                      enumerate(ids[s].reshape(-1)) if e // L == d)
        assert sorted(map(tuple, got[d][:n, :2])) == want   # every such row, once
    back = _simulate(got, [np.full((T * top_k, 3), -1) for _ in range(world)], plan, "comb")
    for s in range(world):
        assert (back[s] == sent[s]).all()                  # home, in the sorted order


def test_skewed_routing_is_skewed(rng):
    n = 4000
    bal = np.bincount(br.routing_ids(rng, n, 64, 8, "balanced").reshape(-1), minlength=64)
    skw = np.bincount(br.routing_ids(rng, n, 64, 8, "skewed").reshape(-1), minlength=64)
    assert bal.max() < 1.2 * bal.mean() and skw.max() > 3 * skw.mean()


def test_bench_ragged_quick_on_cpu(tmp_path, capsys):
    rc = cli.main(["ragged", "--quick", "--tokens", "8", "--routing", "skewed",
                   "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "ragged.json").read_text())
    # measured rows; the "<XLA method> best" rows are copies of XLA's default on CPU devices
    rows = [r for r in data["rows"] if "median_us" in r and "xla_variants" not in r]
    want = {(op, m) for op in ("dispatch", "combine")
            for m in br.METHODS + [br.chunk_method(1024)]}
    assert {(r["op"], r["method"]) for r in rows} == want
    # both sizings; worst: MaxText's T*K x min(W, E/K) rows on a default-sized communicator;
    # the chunk sweep really takes the chunked path with the slot asked for
    assert {r["sizing"] for r in rows} == set(br.SIZINGS)
    for r in rows:
        if r["sizing"] == "worst" and r["op"] == "dispatch":
            assert r["capacity_rows"] >= br.worst_rows(8, r["top_k"], r["experts"], r["world"])
        if r["method"].startswith("nvc chunk"):
            assert r["chunk_bytes"] == 1024, r
        elif r["method"] == "nvc":
            assert r["chunk_bytes"] >= 0
    best = {(r["op"], r["method"]): r for r in data["rows"] if "xla_variants" in r}
    assert set(best) == {(op, f"{m} best") for op, m in want if m.startswith("xla")}
    for (op, m), b in best.items():
        base = next(r for r in rows if r["op"] == op and r["method"] == m[:-len(" best")]
                    and r["sizing"] == b["sizing"])
        assert b["median_us"] == base["median_us"] and b["xla_flags"] == "default"
        assert "CPU devices" in b["xla_best_note"]
    for r in rows:
        assert r["median_us"] > 0 and r["tokens"] == 8 and r["routing"] == "skewed"
        if r["method"] != "xla":
            assert r["agree"] is True, r
    assert (tmp_path / "ragged.png").exists() or "matplotlib" in capsys.readouterr().out
