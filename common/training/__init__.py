"""One process's DeepSpeed model and its sleep, checkpoints, the tiny model."""
