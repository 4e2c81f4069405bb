"""The model: architectures, layers, configs, checkpoint loading, and how a CPU runs its linears."""
