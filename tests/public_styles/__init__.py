"""Model code written in the styles of public JAX codebases (one module per codebase), plain
JAX and lax: nothing of jax_nvcomm in them. tests/test_public_styles.py runs each unchanged
under jax.jit and nvc.jit; tests/mp/public_styles_mp.py runs them on GPUs."""
