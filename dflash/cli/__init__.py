"""The ``dflash`` command: the composition root of the command contract
(docs/ARCHITECTURE.md, "The `dflash` command").

:mod:`.command` parses and validates, :mod:`.options` is the option table, :mod:`.verbs` holds one
module per verb (its options and its handler), :mod:`.runs` reads run directories back. Nothing
outside the CLI imports it.
"""

from dflash.cli.command import HANDLERS, VERBS, main
from dflash.cli.runs import load_run_config, trained_conversation_ids

__all__ = ["HANDLERS", "VERBS", "load_run_config", "main", "trained_conversation_ids"]
