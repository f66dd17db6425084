"""TRL: `OffloadSFTTrainer` (TRL's SFTTrainer with the same offload wiring) and `OffloadSFTConfig` (SFTConfig plus
our switches, SFTConfig's own defaults kept). Needs `pip install 'offload-trainer[trl]'`."""
from dataclasses import dataclass

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("OffloadSFTTrainer needs TRL: pip install 'offload-trainer[trl]'") from e

from .args import OffloadFields
from .trainer import OffloadMixin

__all__ = ["OffloadSFTConfig", "OffloadSFTTrainer"]


@dataclass
class OffloadSFTConfig(OffloadFields, SFTConfig):
    """`trl.SFTConfig` plus the offload switches (`offload_optimizer`, `layer_swap`, ...). Every other field, and its
    default, is SFTConfig's (e.g. its learning rate and `max_length`)."""


class OffloadSFTTrainer(OffloadMixin, SFTTrainer):
    """Drop-in replacement for `trl.SFTTrainer` (`SFTConfig` works as is, our switches then take their defaults;
    `OffloadSFTConfig` sets them).

    TRL's collators already mask prompt tokens in `labels`, so the chunked loss keeps completion-only training.
    It never materialises the logits, so TRL's logits-based metrics (token accuracy, entropy) are not logged;
    set `loss_chunk_size = 0` on the config to get them back (and the full logits in memory).
    """
