"""The training loop and its parts: the Trainer, one optimizer step, the hooks around it (the
checkpointer among them), the run's state, evaluation, the weight average, optimizers and
schedules, and health checks. What the folders below it share (precision, RNG, stop signals) is in
sdnet_trainer.runtime."""
