"""``python -m producer``: the ``layertap`` command."""

from producer.cli.app import main

main()
