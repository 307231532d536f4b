"""`python -m jax_nvcomm.bench`: see jax_nvcomm/bench/cli.py."""
import sys

from .cli import main

sys.exit(main())
