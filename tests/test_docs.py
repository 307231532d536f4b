"""The package documents itself: every public function's docstring gives the contract
(Args: / Returns:), the classes' give Args:, and docs/API.md names every public name."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import jax_nvcomm as nvc

API = Path(__file__).resolve().parents[1] / "docs" / "API.md"
FUNCS = ["all_reduce", "all_reduce_rms_norm", "all_gather", "select_strategy", "moe_dispatch",
         "moe_combine", "all_reduce_rms_norm_quant", "ragged_all_to_all", "ragged_dot",
         "select_ragged_dot_strategy"]


@pytest.mark.parametrize("name", FUNCS)
def test_function_docstring_has_args_and_returns(name):
    doc = inspect.getdoc(getattr(nvc, name))
    assert "Args:" in doc and "Returns:" in doc, name
    params = [p for p in inspect.signature(getattr(nvc, name)).parameters]
    args = doc[doc.index("Args:"):doc.index("Returns:")]
    for p in params:
        assert p in args, f"{name}: parameter {p} not described"


@pytest.mark.parametrize("cls", [nvc.Communicator, nvc.MoECommunicator])
def test_class_docstring_describes_its_arguments(cls):
    doc = inspect.getdoc(cls)
    assert "Args:" in doc
    for p in inspect.signature(cls.__init__).parameters:
        if p != "self":
            assert p in doc[doc.index("Args:"):], f"{cls.__name__}: {p}"


def test_api_reference_ships_in_the_repository_and_names_every_public_name():
    text = API.read_text()
    for name in nvc.__all__:
        if name not in ("CUDA_BUILT", "Dispatched", "MoEHandle", "distributed_initialize"):
            assert f"{name}(" in text, name
    for prop in ("xla_fallback", "transport_reason", "JAX_NVCOMM_TEST_HOSTNAME",
                 "python -m jax_nvcomm.topology"):
        assert prop in text
