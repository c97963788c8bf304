"""What a process runs under, below every folder that trains: the precision policy (autocast
dtype, TF32, the fp16 loss scaler), the random state (seeds derived per rank and per purpose, the
generators a checkpoint holds) and the stop signals (SIGTERM/SIGINT to a saved, orderly exit).
These modules import nothing of ours but ``config/`` and ``errors.py``, so ``data/``,
``distributed/``, ``observability/`` and ``training/`` all build on them."""
