"""zero: the training face of zero-tiering: config, engine, ZeRO-3 partitioner, CPU-Adam, precision, checkpoints."""
