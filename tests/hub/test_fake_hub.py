"""The fake Hub answers huggingface_hub as the Hub does: snapshot_download gets every file at
the resolved commit; gated, missing repos and revisions raise huggingface_hub's own errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

from tests.hub.fake_hub import FakeHub


@pytest.fixture
def hub(tmp_path: Path):
    source = tmp_path / "source"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text('{"model_type": "qwen3"}')
    (source / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (source / "sub" / "notes.txt").write_text("nested")
    fake = FakeHub()
    fake.add_repo("org/tiny", source)
    fake.add_repo("org/gated", source, gated=True)
    fake.tokens.add("hf_granted")
    endpoint, server = fake.serve()
    yield fake, endpoint, source
    server.shutdown()


def test_snapshot_download_gets_every_file_at_the_resolved_commit(hub, tmp_path: Path) -> None:
    fake, endpoint, source = hub
    sha = HfApi(endpoint=endpoint).repo_info("org/tiny").sha
    assert sha == fake.repos["org/tiny"].sha
    out = Path(snapshot_download("org/tiny", endpoint=endpoint, local_dir=tmp_path / "out", token=False))
    got = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*")
           if p.is_file() and ".cache" not in p.parts}
    assert got == {p.relative_to(source).as_posix(): p.read_bytes() for p in source.rglob("*") if p.is_file()}
    # by commit sha: no revision lookup, the files again
    again = snapshot_download("org/tiny", revision=sha, endpoint=endpoint, cache_dir=tmp_path / "cache",
                              token=False)
    assert (Path(again) / "sub" / "notes.txt").read_text() == "nested"
    assert ("GET", f"/org/tiny/resolve/{sha}/config.json") in fake.requests


def test_gated_repo_needs_a_granted_token(hub, tmp_path: Path) -> None:
    _, endpoint, _ = hub
    for token in (False, "hf_not_granted"):
        with pytest.raises(GatedRepoError):
            snapshot_download("org/gated", endpoint=endpoint, local_dir=tmp_path / "no", token=token)
    out = snapshot_download("org/gated", endpoint=endpoint, local_dir=tmp_path / "yes", token="hf_granted")
    assert (Path(out) / "config.json").is_file()


def test_missing_repo_and_revision(hub, tmp_path: Path) -> None:
    _, endpoint, _ = hub
    with pytest.raises(RepositoryNotFoundError) as missing:
        snapshot_download("org/nothing", endpoint=endpoint, local_dir=tmp_path / "a", token=False)
    assert not isinstance(missing.value, GatedRepoError)
    with pytest.raises(RevisionNotFoundError):
        snapshot_download("org/tiny", revision="v9", endpoint=endpoint, local_dir=tmp_path / "b", token=False)
