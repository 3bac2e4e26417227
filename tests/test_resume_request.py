"""``ckpt_path`` parsed once: the four forms, and a refusal naming the option and the forms."""

from __future__ import annotations

from pathlib import Path

import pytest

from unison.checkpointing.resume import ResumeKind, ResumeRequest
from unison.errors import ConfigurationError


@pytest.mark.parametrize(
    ("given", "kind", "path"),
    [
        (None, ResumeKind.FRESH, None),
        ("auto", ResumeKind.AUTO, None),
        ("last", ResumeKind.LAST, None),
        ("runs/x/checkpoints/step-00000004", ResumeKind.PATH, "runs/x/checkpoints/step-00000004"),
        (Path("ckpt/step-00000002"), ResumeKind.PATH, Path("ckpt/step-00000002")),
        ("s3://bucket/run/step-00000002", ResumeKind.PATH, "s3://bucket/run/step-00000002"),
        # The forms are read from the text, whatever its type; ./auto names a directory called auto.
        (Path("last"), ResumeKind.LAST, None),
        ("./auto", ResumeKind.PATH, "./auto"),
    ],
)
def test_each_form_parses_to_its_kind(given, kind, path):
    request = ResumeRequest.parse(given)
    assert (request.kind, request.path) == (kind, path)
    assert request.fresh is (kind is ResumeKind.FRESH)
    assert request.newest is (kind in (ResumeKind.AUTO, ResumeKind.LAST))
    assert str(request) == str(given)


def test_parsing_a_request_again_returns_it():
    request = ResumeRequest.parse("last")
    assert ResumeRequest.parse(request) is request


@pytest.mark.parametrize("given", ["", 3, 1.5, ["auto"], b"auto"])
def test_anything_else_is_refused_naming_ckpt_path_and_the_forms(given):
    with pytest.raises(ConfigurationError) as info:
        ResumeRequest.parse(given)
    assert info.value.option == "ckpt_path"
    message = str(info.value)
    for form in ("None", "'auto'", "'last'", "checkpoint directory"):
        assert form in message


def test_only_a_path_request_has_a_local_path():
    assert ResumeRequest.parse("ckpt/step-00000001").local_path == Path("ckpt/step-00000001")
    with pytest.raises(ValueError):
        _ = ResumeRequest.parse("auto").local_path
