"""Co-location of several models on MPS shares of one GPU: InSS's interference-aware latency model,
placement policies behind one interface (``policy.make_policy``), and their simulated evaluation.
See docs/colocation.md."""
