"""The command, `offload-trainer`: main.py parses arguments and turns every ending into a sentence and an exit code;
recipe.py is the training recipe, top to bottom (checks, plan, model, data, trainer, outputs), earlier_run.py what
the output directory already holds; config.py and
limits.py read and check a YAML config; run_args.py holds its model and data keys; keys, report, merge and examples
are the other subcommands."""
from .main import exit_code_of, main

__all__ = ["main", "exit_code_of"]
