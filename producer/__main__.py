"""``python -m layertap.producer`` (and, deprecated, ``python -m producer``): the ``layertap`` command, as
``python -m layertap``."""

from layertap.producer.cli.app import main

main()
