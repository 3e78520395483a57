"""Benchmarks and experiments: every ``daskpipe bench`` command (registered in ``cli``) and
``daskpipe experiments``. They import the library; no library layer imports them."""
