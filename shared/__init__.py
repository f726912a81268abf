"""What every replica must agree on: run config, noise, model, fitness, update, file formats."""
