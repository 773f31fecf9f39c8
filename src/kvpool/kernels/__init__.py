"""Native kernels: C sources compiled at first use with the system C compiler (see cpu.py),
and Triton kernels (imported only when the triton backend runs).

May import: memory (page formats), rope and kvpool's shared modules."""

# Most context splits a Triton decode call uses: the engine sizes its workspace for it.
MAX_DECODE_SPLITS = 32


def decode_scratch_bytes(batch: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """Bytes of the scratch a Triton decode of `num_splits` > 1 context splits takes: float32
    partial outputs, each head_dim padded to a power of two as the kernel tiles it (576, an
    MLA latent, takes 1024), and a log-sum-exp, per sequence, head and split."""
    padded = 1 << (head_dim - 1).bit_length()
    return batch * num_heads * num_splits * (padded + 1) * 4
