"""The ``layertap`` command: ``app`` holds the root and its ``main``; one module per command group.

:func:`main` is the entry point (``layertap = "layertap.producer.cli:main"``); it imports the app when
it runs, so importing a command module does not import them all.
"""


def main() -> None:
    """Run the ``layertap`` command."""
    from layertap.producer.cli.app import main as run

    run()
