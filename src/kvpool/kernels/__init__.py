"""Native kernels: C sources compiled at first use with the system C compiler (see cpu.py)."""
