"""The size of the 8-bit AdamW states, in one place (the optimizer allocates them, the planner and the Trainer's disk
check count them): torchao's blockwise format, a uint8 code per value and an fp32 scale per block of 256, for each of
the two moments."""
BLOCK = 256
STATE_BYTES_PER_VALUE = 2 * (1 + 4 / BLOCK)  # (for a sum over many tensors; one tensor: `state_bytes`)


def state_bytes(numel: int, block_size: int = BLOCK) -> int:
    """Bytes of one tensor's two 8-bit moments: a code per value and an fp32 scale per block, each."""
    return 2 * numel + 2 * 4 * (numel // block_size)
