"""Dataset rows with image parts (``layertap.producer.ingest``): JSONL and parquet rows in OpenAI and
Hugging Face part forms become chat jobs whose image paths are read under the images root
only (sha256 filled in, so the job id covers the bytes), and rows naming an image outside
it, a missing or undecodable one, or a path with no root are bad rows with the reason."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from layertap.producer.ingest.enqueue import BadRow, Planned, plan_jobs
from layertap.producer.ingest.formats import RowConverter
from layertap.producer.ingest.sources import open_source
from layertap.protocol.images import ImagePart, ImageUrlPart, TextPart
from layertap.settings import Limits


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 40)).save(buffer, format="PNG")
    return buffer.getvalue()


def image_row(part: dict, text: str = "what is it") -> dict:
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": text}]},
                         {"role": "assistant", "content": "a green square"}]}


def hf(source: str) -> dict:
    return {"type": "image", "image": source}


def openai(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def planned(path, root) -> list[Planned | BadRow]:
    return list(plan_jobs(open_source(path).rows, RowConverter(), {"model": "vlm", "run": "images"},
                          origin="f", images_root=root, limits=Limits(max_image_bytes=1 << 16)))


def test_image_rows_become_jobs_with_paths_read_under_the_root_only(tmp_path):
    root = tmp_path / "images"
    (root / "set").mkdir(parents=True)
    (root / "set" / "a.png").write_bytes(png(8, 6))
    (root / "set" / "b.png").write_bytes(png(9, 6))
    (root / "broken.png").write_bytes(b"not an image")
    (tmp_path / "outside.png").write_bytes(png(8, 6))
    os.symlink(tmp_path / "outside.png", root / "link.png")
    url = "data:image/png;base64," + base64.b64encode(png(5, 5)).decode()
    rows = [image_row(hf("set/a.png")), image_row(openai(url)), image_row(hf("set/b.png")),
            image_row(hf("../outside.png")), image_row(hf(str(tmp_path / "outside.png"))), image_row(hf("link.png")),
            image_row(hf("missing.png")), image_row(hf("broken.png"))]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    items = planned(path, root)
    assert [type(item).__name__ for item in items] == ["Planned"] * 3 + ["BadRow"] * 5, items
    first, second, third = (item.job for item in items[:3])
    part = first.messages[0].content[0]
    assert isinstance(part, ImagePart) and part.sha256 == hashlib.sha256(png(8, 6)).hexdigest()
    assert isinstance(second.messages[0].content[0], ImageUrlPart)
    assert isinstance(first.messages[0].content[1], TextPart)
    assert len({first.job_id, third.job_id}) == 2  # the same chat with other image bytes is another job
    reasons = [item.reason for item in items[3:8]]
    assert "not a plain relative path" in reasons[0] and "not a plain relative path" in reasons[1]
    assert "leads out of the images root" in reasons[2]
    assert "is not a file under the images root" in reasons[3]
    assert "does not decode" in reasons[4]
    sharegpt = tmp_path / "sharegpt.jsonl"
    sharegpt.write_text("".join(json.dumps(row) + "\n" for row in [
        {"conversations": [{"from": "human", "value": [hf("set/a.png"), "what is it"]},
                           {"from": "gpt", "value": "a green square"}]},
        {"conversations": [{"from": "human", "value": [{"type": "audio", "audio": "a.wav"}]}]}]))
    same, audio = planned(sharegpt, root)
    assert same.job.job_id == first.job_id  # ShareGPT turns with parts: the same chat, the same job
    assert "content of type audio" in audio.reason
    without_root = planned(path, None)
    assert isinstance(without_root[1], Planned)  # a data URL needs no root
    assert "no images root is configured" in without_root[0].reason


def test_parquet_rows_with_image_parts(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    (root / "a.png").write_bytes(png(8, 6))
    rows = [image_row(hf("a.png")), image_row(hf("a.png"), "and now")]
    for row in rows:  # a parquet column holds one type: every turn's content as parts
        row["messages"][1]["content"] = [{"type": "text", "text": "a green square"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    items = planned(tmp_path / "rows.parquet", root)
    assert all(isinstance(item, Planned) for item in items), items
    assert all(item.job.messages[0].content[0].sha256 == hashlib.sha256(png(8, 6)).hexdigest() for item in items)
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [item.job.job_id for item in items] == [item.job.job_id for item in planned(jsonl, root)]
