"""Where job files live, chosen by URL: one :class:`~layertap.storage.base.Storage` interface
(``base``), a local folder (``local``, with its lock protocol in ``locking``), object stores
through fsspec (``fsspec_store``), and the scheme table (``registry``). Torch-free; it sits just
above ``layertap.protocol`` so the worker and the file readers both use it."""
