"""OffloadSFTTrainer: TRL's SFTTrainer with the same offload wiring (needs `pip install trl`)."""
try:
    from trl import SFTTrainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("OffloadSFTTrainer needs TRL: pip install 'offload-trainer[trl]'") from e

from .trainer import OffloadMixin


class OffloadSFTTrainer(OffloadMixin, SFTTrainer):
    """Drop-in replacement for `trl.SFTTrainer`."""
