"""The C kernels for the CPU: their sources (``csrc/``) and the loader that builds and calls them (``cpu``)."""
