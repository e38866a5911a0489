"""The ground floor: what every kernel family, the public API and the tuner share.

errors, version, cache_dir (cache root, atomic writes, quarantine of corrupt files), tuned_store
(the tuned-results store: dispatch reads it, the tuner writes it), device (GPU identity and
figures). Imports nothing of this project outside this package; importing it loads no torch.
"""
