"""``python -m layertap``: the ``layertap`` command."""

from layertap.producer.cli.app import main

main()
