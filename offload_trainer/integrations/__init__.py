"""Entry points for the tools fine-tuners already run (axolotl, LLaMA-Factory). Each imports its tool only when used."""
