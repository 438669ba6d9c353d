"""Image parts in chat jobs (``layertap.protocol.images``): the two wire forms, where bytes may
come from, the content hash over image bytes, and the client-side checks. No torch."""

from __future__ import annotations

import base64
import io
import os

import pytest
from PIL import Image
from pydantic import ValidationError

from layertap.protocol.images import ImageError, load_images, with_image_digests
from layertap.protocol.schema import Job

MAX_BYTES = 1 << 20


def png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(*parts: dict) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "what is it"}]},
                                       {"role": "assistant", "content": "a red square"}]}


def openai_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def hf_part(source: str) -> dict:
    return {"type": "image", "image": source}


@pytest.fixture
def images_root(tmp_path):
    root = tmp_path / "images"
    (root / "cats").mkdir(parents=True)
    (root / "cats" / "one.png").write_bytes(png(8, 6))
    return root


def test_both_forms_parse_and_their_checks_pass(images_root):
    data = with_image_digests(chat(openai_part(data_url(png(4, 4))), hf_part("cats/one.png")), images_root, MAX_BYTES)
    job = Job.model_validate(data)
    assert len(job.images()) == 2
    assert job.messages[0].text == "what is it"
    loaded = load_images(job.messages, images_root, max_images=2, max_bytes=MAX_BYTES)
    assert [len(image.data) for image in loaded] == [len(png(4, 4)), len(png(8, 6))]


def test_the_job_id_covers_the_bytes_of_an_image_path(images_root):
    first = Job.model_validate(with_image_digests(chat(hf_part("cats/one.png")), images_root, MAX_BYTES)).with_id()
    (images_root / "cats" / "one.png").write_bytes(png(8, 6, (0, 0, 255)))
    second = Job.model_validate(with_image_digests(chat(hf_part("cats/one.png")), images_root, MAX_BYTES)).with_id()
    assert first.job_id != second.job_id
    other = Job.model_validate(chat(openai_part(data_url(png(4, 4, (1, 2, 3)))))).with_id()
    assert other.job_id != Job.model_validate(chat(openai_part(data_url(png(4, 4))))).with_id().job_id
    with pytest.raises(ImageError, match="no longer has the bytes"):  # the file changed after the job was made
        load_images(first.messages, images_root, max_images=4, max_bytes=MAX_BYTES)


def test_a_path_part_without_its_digest_is_not_a_job():
    with pytest.raises(ValidationError, match="needs the sha256"):
        Job.model_validate(chat(hf_part("cats/one.png")))


@pytest.mark.parametrize("source", ["/etc/passwd", "../secret.png", "cats/../../x.png", "./cats/one.png",
                                    "https://example.com/a.png", "file:///etc/passwd", "data:text/plain;base64,aGk="])
def test_paths_outside_the_root_and_remote_urls_are_refused(source, images_root):
    with pytest.raises((ValidationError, ValueError)):
        Job.model_validate(with_image_digests(chat(hf_part(source)), images_root, MAX_BYTES))


@pytest.mark.parametrize("source", ["/etc/passwd", "../secret.png", "https://example.com/a.png"])
def test_a_bad_path_is_refused_even_with_a_digest(source):
    """A raw job (not through the Client) that names a path outside the root with any sha256."""
    with pytest.raises(ValidationError):
        Job.model_validate(chat(hf_part(source) | {"sha256": "0" * 64}))


def test_a_link_out_of_the_root_is_refused(images_root, tmp_path):
    (tmp_path / "outside.png").write_bytes(png(2, 2))
    os.symlink(tmp_path / "outside.png", images_root / "link.png")
    with pytest.raises(ImageError, match="leads out of the images root"):
        with_image_digests(chat(hf_part("link.png")), images_root, MAX_BYTES)


def test_no_root_configured_refuses_paths(images_root):
    with pytest.raises(ImageError, match="no images root is configured"):
        with_image_digests(chat(hf_part("cats/one.png")), None, MAX_BYTES)


def test_size_count_and_decoding_are_checked(images_root):
    big = Job.model_validate(chat(openai_part(data_url(png(64, 64)))))
    with pytest.raises(ImageError, match="the limit is 100"):
        load_images(big.messages, images_root, max_images=4, max_bytes=100)
    many = Job.model_validate(chat(*[openai_part(data_url(png(2, 2)))] * 3))
    with pytest.raises(ImageError, match="3 images; the limit is 2"):
        load_images(many.messages, images_root, max_images=2, max_bytes=MAX_BYTES)
    garbage = Job.model_validate(chat(openai_part(data_url(b"not an image at all"))))
    with pytest.raises(ImageError, match="does not decode as an image"):
        load_images(garbage.messages, images_root, max_images=4, max_bytes=MAX_BYTES)
    bad_base64 = Job.model_validate(chat(openai_part("data:image/png;base64,@@@")))
    with pytest.raises(ImageError, match="not valid base64"):
        load_images(bad_base64.messages, images_root, max_images=4, max_bytes=MAX_BYTES)


def test_text_parts_are_checked_like_text():
    with pytest.raises(ValidationError, match="control character"):
        Job.model_validate({"model": "m",
                            "messages": [{"role": "user", "content": [{"type": "text", "text": "a\x00"}]}]})
    with pytest.raises(ValidationError):
        Job.model_validate({"model": "m", "messages": [{"role": "user", "content": [{"type": "video", "video": "x"}]}]})
