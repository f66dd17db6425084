"""The public path of the TRL trainers (`from offload_trainer.trl import OffloadSFTTrainer`); they live in
integrations/trl.py beside the axolotl and LLaMA-Factory integrations."""
from .integrations.trl import OffloadDPOConfig, OffloadDPOTrainer, OffloadSFTConfig, OffloadSFTTrainer

__all__ = ["OffloadDPOConfig", "OffloadDPOTrainer", "OffloadSFTConfig", "OffloadSFTTrainer"]
