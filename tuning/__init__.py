"""Config search, benchmarking and the tuning cache (see the tuning issue). For now: the shared
timing function used by benchmarks/ and, later, the tuner."""
