"""jax_nvcomm._exchange on a stand-in key-value store (the multi-process tests run the real one):
gather's process order and bounded reads, agree's named difference."""
import jax
import pytest

from jax_nvcomm import _exchange


class Store:
    """The two calls of the distributed client that _exchange uses; a missing key times out."""

    def __init__(self, data):
        self.data = dict(data)
        self.waits = []

    def key_value_set_bytes(self, key, value):
        self.data[key] = value

    def blocking_key_value_get_bytes(self, key, ms):
        self.waits.append(ms)
        if key not in self.data:
            raise TimeoutError(f"deadline exceeded for {key}")
        return self.data[key]


@pytest.fixture
def job(monkeypatch):
    """Process 1 of 3, on a store the test fills: returns a function that installs it."""
    def use(data):
        store = Store(data)
        monkeypatch.setattr(_exchange, "client", lambda: store)
        monkeypatch.setattr(jax, "process_index", lambda: 1)
        monkeypatch.setattr(jax, "process_count", lambda: 3)
        return store
    return use


def test_gather_returns_every_value_in_process_order(job):
    store = job({"k/0": b"zero", "k/2": b"two"})
    assert _exchange.gather("k", b"one", 2.5, "things") == [b"zero", b"one", b"two"]
    assert store.data["k/1"] == b"one"          # this process's value, for the others
    assert store.waits == [2500, 2500]          # one bounded read per other process


def test_gather_names_the_process_that_never_comes(job):
    job({"k/0": b"zero"})
    with pytest.raises(RuntimeError, match=r"timed out after 2 s waiting for process 2's "
                                           r"things \(key 'k/2'\)"):
        _exchange.gather("k", b"one", 2.0, "things")


def test_gather_in_one_process_is_the_value(monkeypatch):
    monkeypatch.setattr(_exchange, "client", lambda: None)
    assert _exchange.gather("k", b"mine", 1.0, "things") == [b"mine"]


def test_agree_names_the_first_difference(job):
    job({"p/cfg/0": b'{"a": 1, "b": 2}', "p/cfg/2": b'{"a": 1, "b": 3}'})
    with pytest.raises(ValueError, match=r"b=2 in process 1 but 3 in process 2"):
        _exchange.agree("p", {"a": 1, "b": 2}, 1.0)
    job({"p/cfg/0": b'{"a": 1, "b": 2}', "p/cfg/2": b'{"a": 1, "b": 2}'})
    _exchange.agree("p", {"b": 2, "a": 1}, 1.0)  # the same configuration: no error
