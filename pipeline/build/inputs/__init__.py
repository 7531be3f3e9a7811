"""What a build reads and checks before it builds: model families (architectures/), the task table, targets,
calibration and validation data, and the checks that a checkpoint folder leads nowhere outside itself, that its
config fits its weights, and that its tokenizer's patterns do not backtrack without bound."""
