"""tests/e2e uses the shared P/D deployment, the ``cluster`` fixture of tests/conftest.py (started once for the
whole run: e2e_mla's tiny-Llama control is its P)."""
