"""TRL: `OffloadSFTTrainer` / `OffloadDPOTrainer` (TRL's SFTTrainer / DPOTrainer with the same offload wiring) and
their configs (TRL's config plus our switches, TRL's own defaults kept). Needs `pip install 'offload-trainer[trl]'`.

Any TRL trainer whose optimizer step is the Trainer's takes the mixin the same way (`class T(OffloadMixin,
KTOTrainer)`); DPO is the one tested here. Trainers that generate during training (GRPO, RLOO, online DPO) step the
same optimizer, but generation with the weights in flight has not been tested: use them with care."""
from dataclasses import dataclass

try:
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("OffloadSFTTrainer needs TRL: pip install 'offload-trainer[trl]'") from e

from ..trainer.args import OffloadFields
from ..trainer.mixin import OffloadMixin

__all__ = ["OffloadDPOConfig", "OffloadDPOTrainer", "OffloadSFTConfig", "OffloadSFTTrainer"]


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


@dataclass
class OffloadDPOConfig(OffloadFields, DPOConfig):
    """`trl.DPOConfig` plus the offload switches; every other field and default is DPOConfig's."""


class OffloadDPOTrainer(OffloadMixin, DPOTrainer):
    """Drop-in replacement for `trl.DPOTrainer`. DPO's loss needs the policy's per-token log-probabilities, so it is
    TRL's own (the chunked loss applies to `labels` batches only). A reference model (`ref_model`, or the copy TRL
    loads when there is no PEFT adapter) sits on the GPU beside the trained one: the plan takes it off the GPU budget.
    With PEFT there is none (the reference is the base with the adapters disabled)."""
