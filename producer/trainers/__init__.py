"""Other trainers' data loaders reading layertap data.

* :mod:`~layertap.producer.trainers.hs_backend`: hs-connectors' backend ``layertap``, so speculators'
  own trainer (``speculators train --hidden-states-backend layertap``) reads an export or a run,
  sealed or while it is extracted (the ``[speculators]`` extra);
* :mod:`~layertap.producer.trainers.rows`: where a speculators data row's file is, torch-free.
"""
