"""The ``layertap`` command: ``app`` holds the root and ``main``; one module per command group."""
