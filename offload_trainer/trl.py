"""OffloadSFTTrainer: TRL's SFTTrainer with the same offload wiring (needs `pip install trl`)."""
try:
    from trl import SFTTrainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("OffloadSFTTrainer needs TRL: pip install 'offload-trainer[trl]'") from e

from .trainer import OffloadMixin


class OffloadSFTTrainer(OffloadMixin, SFTTrainer):
    """Drop-in replacement for `trl.SFTTrainer` (`SFTConfig` works as is; our switches take their defaults).

    TRL's collators already mask prompt tokens in `labels`, so the chunked loss keeps completion-only training.
    It never materialises the logits, so TRL's logits-based metrics (token accuracy, entropy) are not logged;
    set `loss_chunk_size = 0` on the config to get them back (and the full logits in memory).
    """
