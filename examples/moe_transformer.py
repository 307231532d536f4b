#!/usr/bin/env python
"""MoE transformer with jax_nvcomm vs XLA's collectives; the same as `python -m jax_nvcomm.demo`.

    python examples/moe_transformer.py [--layers N --hidden H --experts E --top-k K --tokens T
                                        --decode-tokens D --devices N --dtype DT --plot out.png
                                        --xla-only | --nvcomm-only --save-ref F.npz --ref F.npz]
    python -m jax_nvcomm.launch -n 4 --share-gpu examples/moe_transformer.py --nvcomm-only
        --ref F.npz

The model and runner live in jax_nvcomm/models/moe_transformer.py (so that the installed package can
run them too); `--help` lists every flag.
"""
import os
import sys

try:
    from jax_nvcomm.models.moe_transformer import main
except ModuleNotFoundError as e:  # not installed: use the checkout this script is in
    if e.name != "jax_nvcomm":
        raise
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jax_nvcomm.models.moe_transformer import main

if __name__ == "__main__":
    sys.exit(main(prog="examples/moe_transformer.py"))
