"""Entry points for the tools fine-tuners already run (axolotl). Each imports its tool only when used."""
