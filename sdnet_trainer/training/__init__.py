"""The training loop and its parts: the Trainer, one optimizer step, the hooks around it, the
run's state, evaluation, the weight average, precision, optimizers and schedules, RNG, stop
signals and health checks."""
