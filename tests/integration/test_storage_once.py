"""Storage is resolved once per process, with its options (issue 38, item 2): a worker builds the
storage of its root once, and every file it writes, answers from disk or is read back by path
goes through that one storage (``layertap.storage.registry``: ``storage_for``, ``storage_at``)."""

from __future__ import annotations

from layertap.storage.registry import resolved_storages


def test_a_worker_process_resolves_its_storage_once(tiny_models, tmp_path):
    """The in-process worker (``Extractor``: the worker's own ``build_processor``) writes three
    jobs and answers one again from its file, and the files are read back by path: one storage is
    built in all, its root's. Costs one tiny model load (about a second)."""
    from layertap.producer.files.reader import load_hidden_states
    from layertap.worker import Extractor

    root = tmp_path / "files"
    before = resolved_storages()
    with Extractor(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu", storage_root=str(root)) as extractor:
        results = extractor.extract(["one", "two", "three"]) + extractor.extract(["one"])
    assert [result.ok for result in results] == [True] * 4 and results[3].cached
    for result in results:
        assert load_hidden_states(result.path)
    built = [storage for storage in resolved_storages() if storage not in before]
    assert [storage.root for storage in built] == [str(root)]
