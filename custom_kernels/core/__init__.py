"""The ground floor: what every kernel family, the public API and the tuner share.

errors, version, cache_dir (cache root, private directories, atomic writes, strict JSON,
quarantine of corrupt files), cache_trust (compiled code loads only from a cache no other user
can write to), int_limits (whether an integer fits the C type a launcher takes it in),
tuned_store (the tuned-results store: dispatch reads it, the tuner writes it; every entry parsed
by its family's schema) and tuned_fields (the strict field readers those schemas share), device (GPU identity and
figures), build_cache (the one build cache of nvcc shared objects and NVRTC cubins: keys, locks,
failure records, corruption rule), tolerances (the one table of verification bounds), fallback
(the device rule of the public entry points and the one warning a fallback logs).
Imports nothing of this project outside this package; importing it loads no torch.
"""
