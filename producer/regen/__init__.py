"""On-policy data: regenerate a dataset's assistant turns with the target model behind an
OpenAI-compatible endpoint (``layertap regenerate``)."""
