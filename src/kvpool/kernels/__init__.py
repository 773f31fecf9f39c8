"""Native kernels: C sources compiled at first use with the system C compiler (see cpu.py),
and Triton kernels (imported only when the triton backend runs).

May import: memory (page formats), rope and kvpool's shared modules."""

# Most context splits a Triton decode call uses: the engine sizes its workspace for it.
MAX_DECODE_SPLITS = 32
